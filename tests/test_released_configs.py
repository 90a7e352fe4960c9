"""Released models as their users have them: each family's config.json values from its release
(bench/released_configs/configs.py), at full size, as a checkpoint of safetensors headers only (no disk, no weights),
through the preflight on the CPU. No false refusal: the model checks accept the release's tensors as transformers
writes them, and the estimate is printed. (A check written by hand per projection refused DeepSeek-V2-Lite's latent
attention; its release is one of these.)"""

from __future__ import annotations

import importlib.util

import pytest

from stages import preflight
from stages.config import load_config
from tests.conftest import REPO, write_config

_spec = importlib.util.spec_from_file_location("released_configs", REPO / "bench" / "released_configs" / "configs.py")
released = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(released)


@pytest.mark.parametrize("name", list(released.RELEASES))
def test_a_released_config_at_full_size_passes_the_preflight(name, tmp_path):
    model_dir, asset = released.checkpoint(name, tmp_path / "model")
    base = REPO / "configs" / ("chatml.yaml" if asset == "tiny-chatml" else "default.yaml")
    cfg = load_config(write_config(tmp_path, base=base, model={"name_or_path": str(model_dir)},
                                   preflight={"gpu_memory_gib": 4096}))
    result = preflight.run(cfg, tmp_path / "preflight", train_only=True)
    assert result.fits and result.estimate.total_gib > 0.5, result.estimate.total_gib
    assert "**total**" in result.report_md.read_text()


def test_each_release_s_narrow_copy_keeps_its_widths_heads_experts_and_per_layer_types():
    """The copy bench/released_configs/sweep.py runs through every stage: the release's config.json but the layers and
    the intermediate sizes, all divided by one power of two, with every kind of layer the release has."""
    from transformers import AutoConfig

    for name, (_source, release) in released.RELEASES.items():
        model_type, copy, changed = released.narrow(name)
        assert set(changed) <= {"num_hidden_layers", "layer_types", *released.INTERMEDIATE}, (name, changed)
        divisors = {release[k] / copy[k] for k in released.INTERMEDIATE if k in release}
        assert len(divisors) == 1 and divisors.pop().is_integer(), (name, changed)
        full, small = (AutoConfig.for_model(model_type, **{k: v for k, v in c.items() if k != "model_type"}) for c in (release, copy))
        for per_layer in ("layer_types", "no_rope_layers", "mlp_only_layers"):
            assert set(getattr(full, per_layer, None) or ()) == set(getattr(small, per_layer, None) or ()), (name, per_layer)
