"""`data=hf`: datasets in the hub's formats through the `datasets` library, end to end from the CLI.

No hub here: the tests write the datasets themselves (save_to_disk, parquet) and check that a hub id
that is not in the local cache fails fast, offline, with the way to use a local copy."""

from __future__ import annotations

from pathlib import Path

import datasets
import pytest

from tests.conftest import TINY, read_metrics, run_cli

RUN = [*TINY, "data=hf", "precision=fp32", "train.max_steps=3", "train.eval_steps=3", "train.save_steps=0",
       "data.max_length=64"]


def _rows(n: int) -> dict[str, list]:
    return {"instruction": [f"Add {i} and {i + 1}." for i in range(n)], "input": ["" if i % 2 else "Be brief."
                                                                                   for i in range(n)],
            "output": [f"{2 * i + 1}" for i in range(n)]}


def _cli(tmp_path: Path, args: list[str], env: dict[str, str] | None = None):
    return run_cli([*RUN, *args, f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path,
                   env={"LLMEXP_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1", **(env or {})})


def test_a_save_to_disk_directory_with_alpaca_columns_trains(tmp_path: Path) -> None:
    datasets.Dataset.from_dict(_rows(80)).save_to_disk(str(tmp_path / "alpaca"))
    proc = _cli(tmp_path, [f"data.path={tmp_path / 'alpaca'}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    (start,) = read_metrics(tmp_path / "run", "start")
    assert start["data"] == "hf" and start["data_train_records"] == 60 and start["data_eval_records"] > 0, start
    assert len(read_metrics(tmp_path / "run", "train")) == 3


def test_parquet_files_and_a_dataset_dict_with_an_eval_split(tmp_path: Path) -> None:
    texts = [f"def f{i}(x):\n    return x * {i}\n" for i in range(120)]
    datasets.Dataset.from_dict({"body": texts}).to_parquet(str(tmp_path / "code.parquet"))
    files = f"data.data_files={tmp_path / 'code.parquet'}"
    proc = _cli(tmp_path, ["data.path=parquet", files, "data.text_field=body", "data.packing=true"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    chats = [[{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": f"hello {i}"}]
             for i in range(40)]
    split = datasets.Dataset.from_dict({"conversation": chats}).train_test_split(test_size=0.25, seed=0)
    split.save_to_disk(str(tmp_path / "chat"))
    proc = _cli(tmp_path, [f"data.path={tmp_path / 'chat'}", "data.eval_split=test", "data.messages_field=conversation",
                           "train.resume=never"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    (start,) = read_metrics(tmp_path / "run", "start")
    assert (start["data_train_records"], start["data_eval_records"]) == (30, 10), start


@pytest.mark.parametrize(("args", "says"), [
    (["data.text_field=body"], "data.text_field=body: no such column; the dataset has instruction, input, output"),
    (["data.split=validation"], "has no split 'validation'; it has train"),
])
def test_a_missing_column_or_split_exits_2_naming_what_there_is(tmp_path: Path, args: list[str], says: str) -> None:
    datasets.Dataset.from_dict(_rows(20)).save_to_disk(str(tmp_path / "alpaca"))
    proc = _cli(tmp_path, [f"data.path={tmp_path / 'alpaca'}", *args])
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert says in proc.stderr and "Traceback" not in proc.stderr
    assert not list((tmp_path / "cache").rglob("tokens/*/*.npy"))  # nothing half-built in the token cache


def test_a_hub_id_not_in_the_local_cache_fails_fast_offline(tmp_path: Path) -> None:
    proc = _cli(tmp_path, ["data.path=someone/not-cached-here"], env={"HF_HOME": str(tmp_path / "hf")})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "data.path=someone/not-cached-here: cannot load it" in proc.stderr and "save_to_disk" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_json_file_that_is_not_utf8_exits_2_naming_it(tmp_path: Path) -> None:
    """`datasets` decodes a json builder's rows as they are read: a byte that is not UTF-8 raised
    UnicodeDecodeError there, a traceback and exit 1 (data=json names the line)."""
    lines = [f'{{"text": "line {i} =\\u00e9"}}'.encode() for i in range(40)]
    lines[5] = lines[5].replace(b"=", b"\xff=")
    (tmp_path / "latin.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    proc = _cli(tmp_path, ["data.path=json", f"data.data_files={tmp_path / 'latin.jsonl'}"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"(data.data_files={tmp_path / 'latin.jsonl'}): a data file is not UTF-8 text (byte b'\\xff')" \
        in proc.stderr and not (tmp_path / "run").exists()


def test_a_split_a_file_builder_lacks_is_named_as_the_fault(tmp_path: Path) -> None:
    """It said "cannot read data.data_files as parquet ... point data.data_files at parquet files"."""
    datasets.Dataset.from_dict({"text": [f"line {i}" for i in range(40)]}).to_parquet(str(tmp_path / "a.parquet"))
    proc = _cli(tmp_path, ["data.path=parquet", f"data.data_files={tmp_path / 'a.parquet'}", "data.eval_split=test"])
    assert proc.returncode == 2 and "data.split / data.eval_split: parquet has no such split (Unknown split" \
        in proc.stderr and "leave data.eval_split null" in proc.stderr, proc.stderr[-2000:]


def test_data_files_as_the_message_says_a_split_mapping_and_a_list(tmp_path: Path) -> None:
    """The fix the message above gives, `data.data_files={train: FILES, test: FILES}`, reads each split's files (the
    composed DictConfig went to datasets as the list of its keys: "Unable to find '.../train'"); a list, every file."""
    from omegaconf import OmegaConf

    from llmexp.data.hub import load_split

    for name, rows in (("a", 40), ("b", 10)):
        datasets.Dataset.from_dict({"text": [f"{name} {i}" for i in range(rows)]}).to_parquet(str(tmp_path / name))
    files = {"train": str(tmp_path / "a"), "test": str(tmp_path / "b")}
    source = OmegaConf.create({"path": "parquet", "data_files": files, "config_name": None})
    assert (len(load_split(source, "train")), load_split(source, "test")["text"][0]) == (40, "b 0")
    source.data_files = list(files.values())
    assert len(load_split(source, "train")) == 50


def test_files_with_no_rows_are_named_so_not_as_another_format(tmp_path: Path) -> None:
    """A 0-row parquet file said "cannot read data.data_files as parquet ... point data.data_files at parquet
    files", which it is."""
    from omegaconf import OmegaConf

    from llmexp.data.hub import load_split
    from llmexp.errors import UserError

    datasets.Dataset.from_dict({"text": []}).to_parquet(str(tmp_path / "empty.parquet"))
    source = OmegaConf.create({"path": "parquet", "data_files": str(tmp_path / "empty.parquet"), "config_name": None})
    with pytest.raises(UserError, match=r"data.path=parquet: the split has no rows \(Instruction \"train\""):
        load_split(source, "train")
