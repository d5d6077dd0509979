"""`data.mix`: several `data=hf` datasets sampled by weight, as a pure function of (seed, step).

The sampler is checked on its own (quotas met in every round, each source walked without
replacement, the same stream for any split of the global batch), then end to end: a CLI run on two
parquet sources of different shapes, the exit-2 mistakes, and a kill -9 chain that must end bitwise
equal to the uninterrupted run."""

from __future__ import annotations

import random
from pathlib import Path

import datasets
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmexp.config.derived import MIX_ROUND, mix_quotas
from llmexp.data.datasets import mix_indices
from tests.conftest import TINY, read_metrics, run_cli
from tests.test_resume import Kill, cli_env, fingerprint, kill_resume_chain, run_once


@given(st.lists(st.floats(min_value=1e-3, max_value=1e3), min_size=1, max_size=12))
def test_quotas_fill_the_round_each_within_one_example_of_its_share(weights: list[float]) -> None:
    quotas = mix_quotas(weights)
    assert sum(quotas) == MIX_ROUND
    assert all(abs(q - w / sum(weights) * MIX_ROUND) < 1 for q, w in zip(quotas, weights, strict=True))


def test_every_round_meets_the_quotas_and_each_source_is_walked_without_replacement() -> None:
    quotas, boundaries = (700, 300), np.array([0, 50, 80])
    stream = np.concatenate([mix_indices(3, step, 8, quotas, boundaries) for step in range(375)])  # 3 rounds
    for r in range(3):
        in_round = stream[r * MIX_ROUND:(r + 1) * MIX_ROUND]
        assert [int((in_round < 50).sum()), int((in_round >= 50).sum())] == list(quotas)
    first = [x for x in stream if x < 50][:50]  # source 0's first epoch: each of its 50 examples once
    second = [x for x in stream if x >= 50][:30]
    assert sorted(first) == list(range(50)) and sorted(second) == list(range(50, 80))
    # A pure function of the position: any split of the global batch sees the same stream, and resume too.
    halves = np.concatenate([mix_indices(3, step, 4, quotas, boundaries) for step in range(750)])
    assert np.array_equal(stream, halves)
    assert np.array_equal(mix_indices(3, 200, 8, quotas, boundaries), stream[1600:1608])
    assert not np.array_equal(mix_indices(4, 0, 64, quotas, boundaries), stream[:64])


def _sources(tmp_path: Path) -> list[str]:
    """Two parquet sources of different shapes: code as text, arithmetic as Alpaca records."""
    code = [f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(160)]
    datasets.Dataset.from_dict({"body": code}).to_parquet(str(tmp_path / "code.parquet"))
    alpaca = {"instruction": [f"Add {i} and {i + 1}." for i in range(120)], "input": [""] * 120,
              "output": [f"{2 * i + 1}" for i in range(120)]}
    datasets.Dataset.from_dict(alpaca).to_parquet(str(tmp_path / "alpaca.parquet"))
    return [f"{{path: parquet, data_files: {tmp_path / 'code.parquet'}, text_field: body, weight: 3}}",
            f"{{path: parquet, data_files: {tmp_path / 'alpaca.parquet'}, weight: 1}}"]


def _mix(tmp_path: Path) -> str:
    return f"data.mix=[{', '.join(_sources(tmp_path))}]"


def test_a_mixture_of_two_shapes_trains_from_the_cli(tmp_path: Path) -> None:
    args = [*TINY, "data=hf", _mix(tmp_path), "precision=fp32", "train.max_steps=3", "train.eval_steps=3",
            "train.save_steps=0", "data.max_length=64", f"hydra.run.dir={tmp_path / 'run'}"]
    proc = run_cli(args, cwd=tmp_path, env={"LLMEXP_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    (start,) = read_metrics(tmp_path / "run", "start")
    assert start["data_mix_shares"] == [0.75, 0.25] and start["data_mode"] == "padded", start
    per_source = start["data_train_source_examples"]
    assert len(per_source) == 2 and sum(per_source) == start["data_train_examples"], start
    assert start["data_train_records"] == 60 + 60  # data.max_examples=60 (TINY) caps each source
    assert "hf mix of 2 sources (75.0% / 25.0% of the examples)" in proc.stderr
    assert len(read_metrics(tmp_path / "run", "train")) == 3


def test_a_mixture_of_one_source_has_a_cache_entry_of_its_own(tmp_path: Path,
                                                               capfd: pytest.CaptureFixture[str]) -> None:
    """It shared the plain run's key, found no train_sources.npy there, and warned "cannot be read" as it rebuilt."""
    from llmexp.data.datasets import build_datasets
    from llmexp.data.tokenizer import load_tokenizer
    from tests.conftest import compose

    base = [*TINY, "data=hf", f"data.cache_dir={tmp_path / 'cache'}", "data.max_length=64"]
    one = _sources(tmp_path)[0].replace(", weight: 3", "")
    plain = compose([*base, "data.path=parquet", f"data.data_files={tmp_path / 'code.parquet'}",
                     "data.text_field=body"], tmp_path / "a")
    for cfg in (plain, compose([*base, f"data.mix=[{one}]"], tmp_path / "b")):
        build_datasets(cfg, load_tokenizer(cfg))
    assert "cannot be read" not in capfd.readouterr().err


@pytest.mark.parametrize(("args", "says"), [
    (["data.path=parquet"], "data.path: data.path and data.mix both name the data; keep one"),
    (["data=stdlib"], "data.mix: mixes datasets read by data=hf; data=stdlib reads one source"),
    (["data.mix.1.weight=0"], "data.mix[1].weight: must be a positive number, got 0.0"),
    (["data.mix.1.weight=0.0001"], "data.mix[1].weight: 0.0001 gives this source less than one example in 1000"),
    (["data.mix.1.weight=inf"], "data.mix[1].weight: must be a finite number, got inf"),
    (["data.mix.1.text_field=story"], "data.mix[1].text_field=story: no such column; the dataset has instruction, "
                                      "input, output"),
])
def test_mixture_mistakes_exit_2_naming_the_entry(tmp_path: Path, args: list[str], says: str) -> None:
    proc = run_cli([*TINY, "data=hf", _mix(tmp_path), *args, f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path,
                   env={"LLMEXP_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert says in proc.stderr and "Traceback" not in proc.stderr
    assert not list((tmp_path / "cache").rglob("tokens/*/*.npy"))  # nothing half-built in the token cache


@pytest.mark.slow
def test_kill9_in_a_mixture_resumes_bitwise(tmp_path: Path) -> None:
    """A mixture run killed twice (once mid-window, once at a random step) ends bitwise equal to the
    uninterrupted run: the sampler needs no state beyond the step."""
    env = cli_env(tmp_path / "cache")
    overrides = ("data=hf", _mix(tmp_path), "precision=fp32", "train.gradient_accumulation_steps=2",
                 "data.packing=false")
    code, out = run_once(tmp_path / "reference", overrides, env)
    assert code == 0, out[-3000:]
    rng = random.Random(0)
    kill_resume_chain(tmp_path / "run", overrides, env, [Kill(hook="backward:7"), Kill(at_step=10, jitter_s=0.2)],
                      rng)
    assert fingerprint(tmp_path / "run") == fingerprint(tmp_path / "reference")
