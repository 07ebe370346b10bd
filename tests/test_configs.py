"""Every config composes: each experiment preset with each attention, any registered pattern; the
smoke preset's task settings stay with its ListOps."""

from pathlib import Path

import warnings

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import sparseflash
from sparseflash.masks import MaskSpec
from sparseflash.models import build_model
from sparseflash.models.lra import ATTENTION_KEYS

CONFIG_DIR = str(Path(__file__).resolve().parents[1] / "configs")
EXPERIMENTS = [None, "smoke", "lra/listops", "lra/pathfinder", "lra/image", "lra/text", "lra/retrieval"]
ATTENTIONS = sorted(p.stem for p in (Path(CONFIG_DIR) / "attention").glob("*.yaml"))


def compose_train(overrides, hydra_cfg=False):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose("train", overrides=overrides, return_hydra_config=hydra_cfg)


def test_attention_group_is_complete():
    assert set(ATTENTIONS) >= {"dense", "causal", "butterfly", "local", "bigbird", "longformer", "strided", "random",
                               "sliding_window", "document", "prefix_lm", "dilated"}


@pytest.mark.parametrize("score_mod", ["alibi", "softcap", "relative_bias", "{name: softcap, params: {cap: 5.0}}"])
def test_element_pattern_and_score_mod_from_the_command_line(score_mod):
    """``attention=sliding_window attention.params.window=N attention.score_mod=...`` builds a model
    whose every block runs that mask and score function (and a learnable bias is a parameter)."""
    cfg = compose_train(["attention=sliding_window", "attention.params.window=40", f"attention.score_mod={score_mod}",
                         "attention.backend=blocked"])
    model = build_model(cfg.model, cfg.attention, vocab_size=20, max_len=100, num_classes=3)
    attn = model.encoder.blocks[0].attn
    assert attn.mask_for(101).mask_mod is not None and attn.score_mod is not None
    learnable = [n for n, _ in model.named_parameters() if "score_mod" in n]
    assert bool(learnable) == (score_mod == "relative_bias")
    x = torch.randint(1, 20, (2, 100))
    logits = model({"x": x, "lengths": torch.tensor([100, 57])})
    assert logits.shape == (2, 3) and torch.isfinite(logits).all()


@pytest.mark.parametrize("experiment", EXPERIMENTS)
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_preset_times_attention(experiment, attention, tmp_path):
    overrides = [f"attention={attention}", f"data_root={tmp_path}"]
    if experiment:
        overrides.append(f"experiment={experiment}")
    cfg = compose_train(overrides)
    OmegaConf.resolve(cfg)
    assert cfg.attention.pattern in sparseflash.masks.registered()
    mask = MaskSpec.from_config(cfg.attention, other_keys=ATTENTION_KEYS).build(512, heads=cfg.model.heads)
    assert 0 < mask.density <= 1
    assert cfg.model.dim % cfg.model.heads == 0
    assert cfg.task.name in ("listops", "pathfinder", "image", "text", "retrieval")
    assert cfg.trainer.max_steps > 0 and cfg.logger.wandb is None


def test_default_is_small_listops_with_butterfly():
    cfg = compose_train([])
    assert cfg.task.name == "listops" and cfg.attention.pattern == "butterfly" and cfg.logger.wandb is None


def test_lra_listops_matches_lra_config():
    cfg = compose_train(["experiment=lra/listops"])
    assert (cfg.trainer.max_steps, cfg.trainer.batch_size, cfg.trainer.warmup_steps) == (5000, 32, 1000)
    assert (cfg.model.dim, cfg.model.depth, cfg.model.heads, cfg.model.mlp_dim) == (512, 6, 8, 2048)
    assert cfg.task.max_len == 2000 and cfg.trainer.schedule == "rsqrt"


def test_lra_pathfinder_matches_the_nystromformer_config():
    cfg = compose_train(["experiment=lra/pathfinder"])
    assert (cfg.trainer.max_steps, cfg.trainer.batch_size, cfg.trainer.warmup_steps, cfg.trainer.lr) == (62400, 256, 312, 1e-4)
    assert (cfg.model.dim, cfg.model.depth, cfg.model.heads, cfg.model.mlp_dim) == (64, 2, 2, 128)
    assert (cfg.model.positions, cfg.model.pool, cfg.trainer.schedule) == ("learned", "mean", "linear")


# LRA's attention_dropout_rate per task: the model's default 0.1 where the task's config sets none
# (lra_benchmarks/models/transformer/transformer.py), 0.2 for CIFAR-10 and 0.1 for Pathfinder-32.
LRA_ATTENTION_DROPOUT = {"lra/listops": 0.1, "lra/text": 0.1, "lra/retrieval": 0.1, "lra/image": 0.2,
                         "lra/pathfinder": 0.1}


@pytest.mark.parametrize("experiment", sorted(LRA_ATTENTION_DROPOUT))
def test_lra_presets_drop_attention_probabilities_as_lra_does(experiment):
    """``model.attention_dropout`` reaches every block's SparseAttention (which drops in training only:
    tests/attention/test_dropout.py)."""
    cfg = compose_train([f"experiment={experiment}", "attention.backend=blocked", "model.depth=1", "model.dim=32",
                         "model.mlp_dim=32", "model.heads=2", "attention.block=16"])
    assert cfg.model.attention_dropout == LRA_ATTENTION_DROPOUT[experiment]
    model = build_model(cfg.model, cfg.attention, vocab_size=20, max_len=40, num_classes=3, pair=False)
    assert {block.attn.attn_dropout for block in model.encoder.blocks} == {cfg.model.attention_dropout}


@pytest.mark.parametrize("pattern", sparseflash.masks.registered())
def test_any_registered_pattern_by_name(pattern):
    cfg = compose_train([f"attention.pattern={pattern}"])  # the default's (butterfly's) params are left over
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spec = MaskSpec.from_config(cfg.attention, other_keys=ATTENTION_KEYS)
    assert spec.pattern == pattern and spec.build(256).q_len == 256


def test_pattern_params_from_the_command_line():
    cfg = compose_train(["attention=local", "attention.params.window=3", "+attention.params.extra=1"])
    assert cfg.attention.params.window == 3 and cfg.attention.params.extra == 1


def test_logger_and_launcher_groups():
    cfg = compose_train(["logger=wandb"])
    assert cfg.logger.wandb.mode == "offline"
    cfg = compose_train(["hydra/launcher=slurm"], hydra_cfg=True)
    assert cfg.hydra.launcher._target_.endswith("SlurmLauncher")


def test_smoke_task_settings_stay_with_its_listops(tmp_path):
    cfg = compose_train(["experiment=smoke", f"data_root={tmp_path}"])
    assert cfg.task.data_dir == f"{tmp_path}/listops-smoke" and cfg.task.sizes.train == 256
    for overrides in (["experiment=smoke", "task=text"], ["task=text", "experiment=smoke"]):
        cfg = compose_train([*overrides, f"data_root={tmp_path}"])
        assert cfg.task.data_dir == f"{tmp_path}/imdb" and "sizes" not in cfg.task, overrides
        assert cfg.model.dim == 32 and cfg.trainer.max_steps == 20  # still the smoke preset otherwise
    assert compose_train(["experiment=smoke", "task=listops"]).task.sizes.train == 96000

