"""The public inference API for trained detectors (`from trainer.detect import load_detector`); the code lives
with its family in trainer/families/detection/predict.py."""

from trainer.families.detection.predict import Detector, load_detector

__all__ = ["Detector", "load_detector"]
