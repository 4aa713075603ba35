"""Object detection: torchvision detectors (Faster R-CNN, RetinaNet, FCOS, SSDlite, a tiny FCOS for the demo) and
transformers' RT-DETR v2 and D-FINE (behind the same interface, trainer.families.detection.detectors) fine-tuned
on COCO or YOLO datasets, with COCO mAP evaluation, live prediction samples and the best checkpoint.

The engine's plan applies unchanged (processes, accumulation, precision); what accumulation means depends on
the detector: Faster R-CNN's losses are means over a fixed number of sampled anchors and proposals per image,
so accumulated micro-batches give exactly the gradient of the full batch (for equal-size images and frozen
BatchNorm); FCOS and RetinaNet divide by the number of foreground locations of each micro-batch, and the DETRs
match and normalise per micro-batch, so accumulation is close to, not exactly, the big batch (the row's
`micro_batch_note`); trainable BatchNorm normalises each micro-batch alone.
Autocast covers the training forward only: evaluation and samples run in fp32 (see detection_eval).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.families.detection.data import require_usable, scan_for_config
from trainer.families.detection.images import DetectionImages
from trainer.core.data.stream import position_seed
from trainer.core.runfolder import RunFolder
from trainer.errors import UserError
from trainer.families.protocol import WorkerContext
from trainer.families.detection.eval import compute_metrics, draw_pair, gather, pr_curve_image, predict
from trainer.families.detection.architectures import ARCHITECTURES, TRANSFORMERS
from trainer.families.detection.detectors import build_detector, implementation

FORMAT = "imagetune-detector"
_AUGMENT_STREAM, _SAMPLER_STREAM = 0, 1


class DetectionFamily:
    name = "detection"

    def __init__(self, ctx: WorkerContext):
        self.ctx = ctx
        self.cfg = ctx.config
        self.best_metric = ctx.config.detection.best_metric  # run_io keeps checkpoints/best/ by it
        self.best_mode = "max"
        self.prepared: list[torch.nn.Module] = []
        self.ema = None
        self._curves: tuple[int, dict, dict] | None = None  # (step, curves, metrics) of the last evaluation

    def _say(self, message: str) -> None:
        if self.ctx.rank == 0:
            print(f"detection: {message}", flush=True)

    # ---- model --------------------------------------------------------------------------------------------
    def load(self) -> None:
        cfg, d, ctx = self.cfg, self.cfg.detection, self.ctx
        self.scan = scan_for_config(cfg)  # the classes decide the head; the data itself is set up in prepare_data
        require_usable(self.scan, cfg.data.path)
        self.classes = list(self.scan.classes)
        torch.manual_seed(cfg.seed)  # the same fresh head on every rank and every world size
        self.arch = ARCHITECTURES[cfg.model.path]
        self.impl = implementation(cfg.model.path)
        self.model, info = build_detector(cfg.model.path, len(self.classes), weights=d.weights,
                                          resolution=cfg.data.resolution, max_detections=d.max_detections,
                                          trainable_backbone_layers=d.trainable_backbone_layers,
                                          class_names=self.classes)
        self.frozen_bn = info["frozen_bn"]
        self.model_metadata: dict[str, str] = info["metadata"]
        if d.sync_batchnorm:
            if ctx.device.type != "cuda":
                raise UserError("detection.sync_batchnorm needs CUDA GPUs (SyncBatchNorm refuses CPU modules); this "
                                "run is on the CPU: set detection.sync_batchnorm=false")
            self.model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(self.model)
        self.model.to(ctx.device).train()
        trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        fresh = f"; fresh for {len(self.classes)} classes: {len(info['fresh'])} head tensors" if info["fresh"] else ""
        self._say(f"{cfg.model.path} from weights={d.weights}{fresh}; {trainable / 1e6:.2f}M trainable parameters; "
                  f"backbone BatchNorm {'frozen' if self.frozen_bn else 'trained'}")
        plan = ctx.plan
        if plan.accumulation > 1:
            if self.arch.micro_batch_note:
                ctx.log_warning(f"accumulation {plan.accumulation}: {cfg.model.path} {self.arch.micro_batch_note} "
                                f"(micro-batches of {plan.per_device}), so a step is close to, not exactly, one batch "
                                f"of {plan.total}")
            if info["trainable_bn"]:
                seen = f"{plan.per_device} x {plan.world_size}" if d.sync_batchnorm else str(plan.per_device)
                ctx.log_warning(f"accumulation {plan.accumulation}: {info['trainable_bn']} BatchNorm layers normalise "
                                f"each micro-batch ({seen} images) alone; accumulation does not change that (raise "
                                "batch.per_device, or start from pretrained weights)")

    def trainable_modules(self) -> list[torch.nn.Module]:
        return [self.model]

    def set_prepared(self, modules: list[torch.nn.Module]) -> None:
        self.prepared = modules

    def param_groups(self) -> list[dict]:
        """The backbone at `detection.backbone_lr_scale` x train.lr (the DETR recipes' 0.1), the rest at train.lr."""
        lr, scale = self.cfg.train.lr, self.cfg.detection.backbone_lr_scale
        scale = self.arch.backbone_lr_scale if scale is None else scale
        trained = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        backbone = [p for n, p in trained if n.startswith(self.impl.BACKBONE_PREFIX)]
        rest = [p for n, p in trained if not n.startswith(self.impl.BACKBONE_PREFIX)]
        if scale == 1 or not backbone:
            return [{"params": [p for _, p in trained], "lr": lr}]
        return [{"params": rest, "lr": lr}, {"params": backbone, "lr": lr * scale}]

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """The whole state (parameters and BatchNorm statistics, fp32): a checkpoint is a complete detector.
        Tied tensors (transformers' DETR heads) are stored once per name: safetensors refuses shared storage."""
        state, seen = {}, set()
        for k, v in self.model.state_dict().items():
            v = (v.detach().float() if v.is_floating_point() else v.detach()).cpu().contiguous()
            state[k] = v.clone() if v.untyped_storage().data_ptr() in seen else v
            seen.add(v.untyped_storage().data_ptr())
        return state

    def load_trainable_state(self, state: dict[str, torch.Tensor]) -> None:
        own = self.model.state_dict()
        missing = sorted(set(own) - set(state))
        if missing:
            raise RuntimeError(f"checkpoint lacks {len(missing)} detector tensors, e.g. {missing[0]}")
        self.model.load_state_dict({k: state[k].to(own[k].dtype) for k in own})

    # ---- data ---------------------------------------------------------------------------------------------
    def prepare_data(self) -> int:
        cfg, d, scan = self.cfg, self.cfg.detection, self.scan
        for warning in scan.warnings:
            self.ctx.log_warning(f"data: {warning}")
        res = cfg.data.resolution
        self.train_set = DetectionImages(scan.train, res, flip=cfg.data.flip, augment=d.augment,
                                         warn=self.ctx.log_warning)
        self.val_set = DetectionImages(scan.val, res, warn=self.ctx.log_warning)
        count = len(scan.val) if not d.eval_images else min(d.eval_images, len(scan.val))
        self.eval_indices = list(range(count))
        self.sample_indices = list(range(min(d.sample_images, len(scan.val))))
        boxes = sum(len(r.boxes) for r in scan.train)
        self._say(f"{scan.layout} data: {len(scan.train)} training images ({boxes} boxes), {len(scan.val)} "
                  f"validation images ({scan.val_source}), {len(self.classes)} classes: {', '.join(self.classes)}")
        return len(scan.train)

    # ---- loss ---------------------------------------------------------------------------------------------
    def loss(self, samples) -> torch.Tensor:
        """samples: (position, epoch, index) triples. Augmentation and Faster R-CNN's sampling are seeded by
        each sample's position; the loss is the detector's own (the sum of its loss terms)."""
        return self.loss_of(samples, self.fetch(samples))

    def fetch(self, samples) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
        """The samples' images and boxes, decoded and augmented on the CPU (in a DataLoader worker with
        data.workers > 0, trainer.engine.input): (float images, {"boxes", "labels"} targets)."""
        loaded = self.train_set.load_many([index for _, _, index in samples])
        pairs = [self.train_set.train_sample(item, position_seed(self.cfg.seed, position, _AUGMENT_STREAM))
                 for (position, _, _), item in zip(samples, loaded)]
        return [image for image, _ in pairs], [target for _, target in pairs]

    def loss_of(self, samples, fetched) -> torch.Tensor:
        device = self.ctx.device
        images = [image.to(device, non_blocking=True) for image in fetched[0]]
        targets = [{k: v.to(device, non_blocking=True) for k, v in target.items()} for target in fetched[1]]
        seeds = [position_seed(self.cfg.seed, pos, _SAMPLER_STREAM) for pos, _, _ in samples]
        with self.impl.seeded(self.model, seeds):
            losses = self.prepared[0](images, targets)
        return sum(losses.values())

    # ---- evaluation and samples ---------------------------------------------------------------------------
    def evaluate(self, step: int) -> dict | None:
        """mAP over the validation images, each process predicting its share; rank 0 computes the metric and
        every rank returns the same dict."""
        ctx = self.ctx
        mine, batch, items = self.eval_indices[ctx.rank::ctx.world_size], max(2, ctx.plan.per_device), []
        for start in range(0, len(mine), batch):  # a batch at a time: only boxes are kept, never the images
            chunk = mine[start:start + batch]
            pairs = [self.val_set.eval_sample(i) for i in chunk]
            preds = predict(self.model, [image for image, _ in pairs], ctx.device, batch_size=batch)
            items += [(i, p, t) for i, p, (_, t) in zip(chunk, preds, pairs)]
        items = gather(items, ctx.world_size)
        metrics: dict | None = None
        if ctx.rank == 0:
            items.sort(key=lambda item: item[0])
            metrics, curves = compute_metrics([p for _, p, _ in items], [t for _, _, t in items], self.classes)
            self._curves = (step, curves, metrics)
        if ctx.world_size > 1 and dist.is_available() and dist.is_initialized():
            from trainer.families.components.collectives import broadcast_json

            metrics = broadcast_json(metrics, src=0)  # JSON, not a pickle
        if ctx.rank == 0:
            assert metrics is not None, "rank 0 computed them"
            self._say(f"step {step}: mAP {metrics['map']} mAP50 {metrics['map50']} on {metrics['images']} images")
        return metrics

    def eval_samples(self, step: int):
        """The precision-recall curve of the evaluation just made (rank 0) as a sample, numbered after the
        prediction samples so that the UI shows it as one more column."""
        if self._curves is None or self._curves[0] != step:
            return []
        _, curves, metrics = self._curves
        title = f"precision-recall at IoU 0.5, step {step}: mAP50 {metrics['map50']}, mAP {metrics['map']}"
        caption = f"precision-recall curve (IoU 0.5), mAP50 {metrics['map50']}"
        return [(len(self.sample_indices), caption, pr_curve_image(curves, title))]

    def render_samples(self, step: int):
        """Fixed validation images: true boxes (left), predictions in fp32 (right)."""
        if not self.sample_indices:
            return []
        pairs = [self.val_set.eval_sample(i) for i in self.sample_indices]
        preds = predict(self.model, [image for image, _ in pairs], self.ctx.device)
        threshold = self.cfg.detection.score_threshold
        out = []
        for i, (_, target), pred in zip(self.sample_indices, pairs, preds):
            keep = int((pred["scores"] >= threshold).sum())
            name = Path(self.scan.val[i].path).name
            caption = f"{name}: {keep} predicted (score >= {threshold:g}), {len(target['boxes'])} true"
            out.append((caption, [draw_pair(self.val_set.pixels(i), target, pred, self.classes, threshold)]))
        return out

    # ---- outputs ------------------------------------------------------------------------------------------
    def checkpoint_metadata(self, step: int) -> dict[str, str]:
        """safetensors metadata that makes a weights file loadable on its own (trainer.detect.load_detector)."""
        cfg, d = self.cfg, self.cfg.detection
        return {"format": FORMAT, "architecture": cfg.model.path, "classes": json.dumps(self.classes),
                "resolution": str(cfg.data.resolution), "frozen_bn": str(int(self.frozen_bn)),
                "max_detections": str(d.max_detections), "score_threshold": str(d.score_threshold),
                "step": str(step), "detection_config": json.dumps(asdict(d)), **self.model_metadata}

    def save_outputs(self, out_dir: Path, *, step: int) -> list[str]:
        import shutil

        from safetensors.torch import save_file

        out_dir.mkdir(parents=True, exist_ok=True)
        final = out_dir / "model.safetensors"
        save_file(self.trainable_state(), str(final), metadata=self.checkpoint_metadata(step))
        outputs = [str(final)]
        best = RunFolder(self.ctx.run_dir).best / "trainable.safetensors"
        if best.is_file():
            shutil.copyfile(best, out_dir / "best.safetensors")
            outputs.append(str(out_dir / "best.safetensors"))
        if self.arch.implementation == TRANSFORMERS:  # also as save_pretrained folders, for transformers' API
            from trainer.families.detection.predict import export_transformers

            for weights, folder in ((final, "transformers"), (out_dir / "best.safetensors", "transformers-best")):
                if weights.is_file():
                    outputs.append(str(export_transformers(weights, out_dir / folder)))
        (out_dir / "README.md").write_text(
            f"# {self.cfg.name}: {self.cfg.model.path} detector, {len(self.classes)} classes\n\n"
            f"classes: {', '.join(self.classes)}\n\n"
            "`model.safetensors` holds the final weights, `best.safetensors` those of the best evaluation "
            f"({self.best_metric}). Both carry the class names and the model config in their metadata:\n\n"
            "```python\nfrom trainer.detect import load_detector\n\n"
            "detector = load_detector(\"output/best.safetensors\")\n"
            "for box in detector.predict(\"photo.jpg\"):\n"
            "    print(box[\"name\"], box[\"score\"], box[\"box\"])\n```\n" + (
                "\n`transformers/` (final) and `transformers-best/` hold the same detectors as `save_pretrained` "
                "folders:\n\n```python\nfrom transformers import pipeline\n\n"
                "detect = pipeline(\"object-detection\", model=\"output/transformers-best\")\n"
                "print(detect(\"photo.jpg\", threshold=0.3))\n```\n" if self.arch.implementation == TRANSFORMERS else ""))
        return outputs
