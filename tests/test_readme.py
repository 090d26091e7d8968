"""The README's code runs as written: its Python block, verbatim, on the tiny smoke models (only the model names
swapped, a DISCO export of the tiny draft where the main job would have left one), and its evaluate command parses."""
from __future__ import annotations

import re
import shlex
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
SMOKE_NAMES = {"packaged:qwen2.5-coder-0.5b-instruct": "tiny:1", "packaged:qwen2.5-coder-1.5b-instruct": "tiny:2:32:3"}
"""The packaged pair -> configs/smoke.yaml's draft and target."""


def python_blocks(text: str) -> list[str]:
    """Every fenced ```python block of ``text``, verbatim."""
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.S | re.M)


def export_tiny_disco(folder: Path) -> None:
    """An untrained DISCO predictor of the tiny draft, exported as the main job exports one (its draft fingerprint
    taken from the draft as the main job loads it)."""
    from compute.models import model_fingerprint
    from data_gen.config import GenerateConfig, ModelsConfig
    from data_gen.generate import load_models
    from predictors.disco import DiscoNet, DiscoPolicy
    from predictors.export import export_predictor
    from predictors.inputs import FeatureSpec

    loaded, tok = load_models(GenerateConfig(models=ModelsConfig(draft="tiny:1", target="tiny:2:32:3")))
    spec = FeatureSpec.for_disco()
    policy = DiscoPolicy(DiscoNet(spec.width, hidden_size=8), spec, threshold=0.3)
    export_predictor(policy, folder, {"draft_fingerprint": model_fingerprint(loaded.draft, tok)})


@pytest.mark.slow
def test_readme_python_block_runs_on_the_smoke_models(tmp_path, monkeypatch, capsys):
    blocks = python_blocks(README)
    assert blocks, "README.md has no ```python block"
    export_tiny_disco(tmp_path / "outputs" / "default" / "train" / "disco" / "export")
    monkeypatch.chdir(tmp_path)
    for block in blocks:
        for real, tiny in SMOKE_NAMES.items():
            block = block.replace(real, tiny)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            exec(compile(block, "README.md", "exec"), {"__name__": "readme"})
        precision = [str(w.message) for w in seen if "precision" in str(w.message) or "trained on" in str(w.message)]
        assert not precision, precision
    printed = capsys.readouterr().out
    assert "rounds" in printed and "accepted" in printed


def test_readme_evaluate_command_parses(capsys):
    from pipelines import evaluate

    line = next(x for x in README.splitlines() if "`python -m pipelines.evaluate" in x)
    command = re.search(r"`(python -m pipelines\.evaluate [^`]*)`", line).group(1)
    args = shlex.split(command)[3:]
    with pytest.raises(SystemExit) as e:
        evaluate.main([*args, "--print_config"])
    assert e.value.code == 0
    assert re.search(r"^predictors:\n- REF$", capsys.readouterr().out, flags=re.M)


def test_packaged_models_doc_names_every_pinned_part():
    """docs/packaged-models.md lists every package, file and sha256 that compute.packaged checks."""
    from compute.packaged import PACKAGED_MODELS

    doc = (ROOT / "docs" / "packaged-models.md").read_text()
    for model in PACKAGED_MODELS.values():
        assert model.sha256 in doc and f"{model.total_size:,}" in doc
        for part in model.parts:
            assert f"`{part.distribution}=={model.version}` | `{part.module}/{part.relpath}`" in doc
            assert part.sha256 in doc


def test_a_list_flag_takes_one_bare_value():
    from dataclasses import dataclass, field

    from pipelines.cli import one_item_lists

    @dataclass
    class Config:
        predictors: list[str] = field(default_factory=list)
        origins: list[str] | None = None
        name: str = ""

    assert one_item_lists(Config, ["--predictors", "models:/x@champion", "--name", "a"]) == [
        "--predictors", '["models:/x@champion"]', "--name", "a"]
    assert one_item_lists(Config, ["--origins=target"]) == ['--origins=["target"]']
    kept = ["--predictors", "[a, b]", "--origins", "null", "--name", "[c]", "--predictors+", "d"]
    assert one_item_lists(Config, kept) == kept
