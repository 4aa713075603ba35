"""Presets load onto the typed schema; every problem is reported at once; shipped presets validate."""

from pathlib import Path

import pytest

from trainer.core.config import load_config
from trainer.core.config.load import MIGRATIONS, migrate, to_yaml
from trainer.core.config.schema import SCHEMA_VERSION, iter_keys
from trainer.errors import ConfigError, UserError

PRESETS = sorted((Path(__file__).parent.parent / "presets").glob("*.yaml"))


@pytest.mark.parametrize("preset", PRESETS, ids=[p.stem for p in PRESETS])
def test_every_shipped_preset_validates(preset):
    config = load_config(preset, check_paths=False)
    assert config.version == SCHEMA_VERSION
    # the resolved YAML of a run folder loads back to the same config
    assert load_config(_write(preset.parent.parent / ".pytest_cache" / preset.name, to_yaml(config)),
                       check_paths=False) == config


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_every_key_is_documented():
    undocumented = [name for name, f in iter_keys() if not f.metadata.get("help")]
    assert undocumented == []


def test_overrides_apply_on_top_of_the_preset(tmp_path):
    preset = _write(tmp_path / "p.yaml", "train:\n  steps: 10\n  lr: 0.1\n")
    config = load_config(preset, ["train.lr=1e-4", "sample.prompts=[a cat, a dog]", "devices=cpu:2"],
                         check_paths=False)
    assert config.train.steps == 10 and config.train.lr == 1e-4
    assert config.sample.prompts == ["a cat", "a dog"] and config.devices == "cpu:2"


def test_all_problems_are_reported_at_once_with_suggestions():
    with pytest.raises(ConfigError) as err:
        load_config({"train": {"learning_rate": 1e-4, "lr": -1, "steps": "many"}, "precison": "bf16",
                     "model": {"family": "sdxx"}, "batch": {"total": 0}, "devices": "gpu"})
    text = str(err.value)
    assert "train.learning_rate: unknown key (did you mean 'train.lr'?)" in text
    assert "precison: unknown key (did you mean 'precision'?)" in text
    assert "train.steps:" in text and "Integer" in text
    assert "train.lr: must be greater than zero, got -1.0" in text
    assert "batch.total: must be greater than zero" in text
    assert "model.family: 'sdxx' is not one of sd" in text
    assert "devices: 'gpu' is not auto" in text
    assert "model.path: is empty" in text and "data.path: is empty" in text
    assert len(err.value.problems) == 9


def test_missing_paths_are_named(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config({"model": {"path": str(tmp_path / "nope")}, "data": {"path": str(tmp_path / "gone")}})
    assert f"model.path: '{tmp_path / 'nope'}' does not exist" in str(err.value)
    assert f"data.path: folder '{tmp_path / 'gone'}' does not exist" in str(err.value)


def test_zero_or_negative_learning_rate_is_refused():
    for lr in (0, -1e-4):
        with pytest.raises(ConfigError, match="train.lr: must be greater than zero"):
            load_config({"train": {"lr": lr}}, check_paths=False)


def test_bad_yaml_and_missing_preset_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = _write(tmp_path / "bad.yaml", "train: [unclosed\n")
    with pytest.raises(UserError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(UserError, match="KEY=VALUE"):
        load_config(None, ["train.lr"], check_paths=False)


def test_prior_preservation_needs_its_keys():
    with pytest.raises(ConfigError) as err:
        load_config({"prior": {"enabled": True}}, check_paths=False)
    assert "prior.class_prompt" in str(err.value) and "prior.class_path" in str(err.value)


def test_migrations_run_in_order_and_newer_versions_are_refused(monkeypatch):
    monkeypatch.setattr("trainer.core.config.load.SCHEMA_VERSION", 3)
    def rename(raw):
        raw["renamed"] = raw.pop("old")
        return raw

    monkeypatch.setitem(MIGRATIONS, 1, rename)
    monkeypatch.setitem(MIGRATIONS, 2, lambda raw: {**raw, "twice": raw["renamed"] * 2})
    assert migrate({"version": 1, "old": 4}) == {"version": 3, "renamed": 4, "twice": 8}
    with pytest.raises(ConfigError, match="newer than this trainer"):
        migrate({"version": 4})


def test_min_snr_gamma_is_refused_for_flow_matching_with_the_key_that_does_the_job():
    for family in ("flux", "sd3"):
        with pytest.raises(ConfigError, match=r"train.min_snr_gamma: 5.0 is for the UNet families.*flow.weighting"):
            load_config(None, [f"model.family={family}", "train.min_snr_gamma=5"], check_paths=False)
    assert load_config(None, ["train.min_snr_gamma=5"], check_paths=False).train.min_snr_gamma == 5


def test_a_bad_override_is_blamed_on_the_command_line_not_the_preset_file(tmp_path):
    demo = Path(__file__).parent.parent / "presets" / "demo.yaml"
    with pytest.raises(ConfigError) as only_ours:
        load_config(demo, ["train.lr=-1"], check_paths=False)
    message = str(only_ours.value)
    assert message.startswith("the command line has 1 problem") and "demo.yaml" not in message
    assert only_ours.value.problems == ["train.lr: must be greater than zero, got -1.0 "
                                        "(set on the command line: train.lr=-1)"]
    # The preset's own problem stays the preset's; the override's is named as the override.
    bad = _write(tmp_path / "bad.yaml", "train: {steps: 0}\n")
    with pytest.raises(ConfigError) as both:
        load_config(bad, ["data.resolution=33"], check_paths=False)
    assert str(both.value).startswith(f"preset '{bad}', with the command line's overrides, has 2 problems")
    assert any(p.startswith("train.steps:") and "command line" not in p for p in both.value.problems)
    assert any(p.startswith("data.resolution:") and p.endswith("(set on the command line: data.resolution=33)")
               for p in both.value.problems)
