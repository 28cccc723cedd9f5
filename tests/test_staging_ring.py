"""The pinned staging ring of offloaded uploads is safe for any number of threads.

Each upload casts on the host into a staging slot and copies the slot to the device;
two threads sharing a slot would upload each other's values. Oracle: every destination
holds exactly the values its own thread cast (a distinct constant per call), also when
threads outnumber the slots; the ring never grows past its slot count.
"""

from __future__ import annotations

import concurrent.futures

import torch

from zero_strategy._mechanisms.transfers import Transfers


def test_concurrent_uploads_never_share_a_slot():
    transfers = Transfers(torch.device("cpu"), pin_memory=False)
    numel, calls = 4096, 400

    def upload(k: int) -> bool:
        src = torch.full((numel,), float(k), dtype=torch.float32)
        dst = torch.empty(numel, dtype=torch.bfloat16)
        transfers.upload_cast(dst, src).synchronize()
        return bool((dst == float(k)).all())  # k < 256: exact in bf16

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        ok = list(pool.map(lambda k: upload(k % 256), range(calls)))
    assert all(ok), f"{ok.count(False)} of {calls} uploads carried another thread's values"
    assert len(transfers.staging_tensors()) <= 2
