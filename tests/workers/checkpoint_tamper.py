"""Load each damaged checkpoint of args["paths"] on every rank; report what each rank raised.

A refusal must come on every rank with the same message (no rank may hang or load).
"""

from __future__ import annotations

import zero_strategy as zs
from _worker import finish, start
from _tamper import tiny


def main() -> None:
    args, out = start()
    results = {}
    for case_id, path in args["paths"].items():
        model, opt = tiny()
        try:
            zs.load_checkpoint(path, model, opt)
            results[case_id] = "loaded"
        except zs.CheckpointError as err:
            results[case_id] = str(err)
        zs.teardown(model, keep_weights=False)
    finish(out, {"results": results})


if __name__ == "__main__":
    main()
