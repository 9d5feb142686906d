"""A model's config resolved once by transformers, then read back from the cache: the engine sees the same model."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from serving.engine.loader import load_model
from serving.engine.spec_draft import parameter_count
from serving.engine.stopping import eos_ids
from serving.engine.utilisation import ModelShape
from serving.models.base import ModelDims
from serving.models.layers.rope import rope_frequencies
from serving.models.registry import family
from serving.models.resolved_config import ResolvedConfig
from tests import encoder_models, family_models


def _model(name: str) -> str:
    if name == "tiny-random":
        return name
    if name == "bert":
        return str(encoder_models.build())
    return str(family_models.build(name))


@pytest.mark.parametrize("name", ["tiny-random", *family_models.FAMILIES, "bert"])
def test_the_cached_config_is_the_config_the_engine_reads(name, tmp_path):
    """The first load resolves with transformers and stores; the second reads the store and must give the engine
    everything the first gave it: every attribute, the family, the sizes, the rope tables, the EOS ids."""
    spec = _model(name)
    cache = tmp_path / "cache"
    if name == "tiny-random":  # its model directory is built in the default cache; only the configs go to `cache`
        spec = str(load_model("tiny-random").path)
    first, second = load_model(spec, cache_dir=cache), load_model(spec, cache_dir=cache)
    real, view = first.hf_model.config, second.hf_model.config
    assert not isinstance(real, ResolvedConfig) and isinstance(view, ResolvedConfig)
    assert len(list((cache / "configs").iterdir())) == 1
    for key, value in json.loads(json.dumps(real.to_dict())).items():
        if key != "architectures":
            assert json.loads(json.dumps(getattr(view, key))) == value, key
    assert view.architectures == [first.architecture] == [second.architecture]
    assert family(real) is family(view)
    if first.encoder:
        return
    assert ModelDims.from_hf_config(real) == ModelDims.from_hf_config(view)
    assert parameter_count(real) == parameter_count(view)
    assert ModelShape.served(real, "float32", "none") == ModelShape.served(view, "float32", "none")
    (f_inv, f_scale), (s_inv, s_scale) = rope_frequencies(real), rope_frequencies(view)
    assert torch.equal(f_inv, s_inv) and f_scale == s_scale
    assert eos_ids(first) == eos_ids(second) and eos_ids(first)


def test_an_edited_config_is_resolved_again(tmp_path):
    """The store is keyed by the files' bytes: an edited config.json is never answered from an old entry."""
    src = load_model("tiny-random").path
    model = tmp_path / "model"
    shutil.copytree(src, model)
    cache = tmp_path / "cache"
    assert load_model(str(model), cache_dir=cache).hf_model.config.num_hidden_layers == 2
    cfg = json.loads((model / "config.json").read_text())
    cfg["num_hidden_layers"] = 1
    (model / "config.json").write_text(json.dumps(cfg))
    edited = load_model(str(model), cache_dir=cache).hf_model.config
    assert not isinstance(edited, ResolvedConfig) and edited.num_hidden_layers == 1
    assert load_model(str(model), cache_dir=cache).hf_model.config.num_hidden_layers == 1
    assert len(list((cache / "configs").iterdir())) == 2


def test_a_scheduler_start_with_a_resolved_config_does_not_import_transformers():
    """transformers' import and its config module cost ~1.7 s of CPU at every Scheduler start and restart."""
    subprocess.run(
        [sys.executable, "-c", "from serving.engine.loader import load_model; load_model('tiny-random')"], check=True
    )
    code = (
        "import sys\n"
        "from serving.args import ServerArgs\n"
        "from serving.engine.loader import load_model\n"
        "from serving.engine.scheduler_core import SchedulerCore\n"
        "core = SchedulerCore(load_model('tiny-random'), ServerArgs(model='tiny-random', dtype='float32'))\n"
        "print(core.runner.vocab_size, sorted(m for m in sys.modules if m.startswith('transformers'))[:3])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split(" ", 1)[1].strip() == "[]" and int(out.split()[0]) > 0
