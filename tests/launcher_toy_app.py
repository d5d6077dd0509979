"""A throwaway Hydra app for the local launcher tests: llmexp's config tree and launchers, but a task
that only records where and when it ran, then sleeps, raises or kills itself, chosen per job by
`model.name` (ok | raise | kill | usererror) with `lr` as the seconds to sleep. Starts in ~1 s, no torch."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from omegaconf import DictConfig


def task(cfg: DictConfig) -> int:
    from hydra.core.hydra_config import HydraConfig

    out = Path(HydraConfig.get().runtime.output_dir)
    record = {"pid": os.getpid(), "ppid": os.getppid(), "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
              "omp": os.environ.get("OMP_NUM_THREADS"), "start": time.time()}
    mode = cfg.model.name
    if mode == "raise":
        raise RuntimeError("toy job failure")
    if mode == "usererror":
        from llmexp.errors import UserError
        from llmexp.train.guarded import user_error_exit

        return user_error_exit(UserError("toy: data.train_file=/nowhere.jsonl does not exist; fix the path"))
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(float(cfg.lr))
    record["end"] = time.time()
    (out / "toy.json").write_text(json.dumps(record))
    return 0


def main() -> None:
    import hydra

    from llmexp.config.schema import register_configs
    from llmexp.config.tree import conf_dir, register_resolvers

    register_configs()
    register_resolvers()
    hydra.main(version_base="1.3", config_path=str(conf_dir()), config_name="config")(task)()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
