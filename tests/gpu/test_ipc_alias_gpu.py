"""weight_sync.ipc_alias on a GPU: a storage the trainer keeps (the policy's one buffer, which
Trainer.weight_buckets hands to sglang as it is) goes to another process by CUDA IPC through its
alias, the receiver reads its bytes, and the trainer's storage is left as it was.

Sent directly, torch wraps the sent storage's memory in its IPC reference count: freed while a
receiver still holds it, the memory goes to torch's limbo instead of back to the allocator (so a
kept buffer would be wrapped once more every sync). Sent through the alias, the alias takes the
wrapping: the trainer's storage frees at once even while the receiver holds its view.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MiB = 1 << 20


def _receiver(inbox: Any, outbox: Any, sglang_reductions: bool) -> None:
    torch.cuda.set_device(0)
    if sglang_reductions:
        # An sglang engine started in the sender's process (an earlier test in the same pytest
        # run) swaps torch's CUDA tensor reducer for sglang's, whose rebuild needs the same
        # patch on the receiving side: sglang's schedulers apply it, a plain process must too.
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        monkey_patch_torch_reductions()
    received = inbox.get()  # rebuilt from the IPC handle, held until told
    outbox.put(float(received.view(torch.float32).double().sum()))
    inbox.get()
    del received


def _freed_while_held(alias: bool) -> tuple[float, float, int]:
    """(the sum the receiver read, the sum sent, bytes the allocator got back) when the sender
    resizes the sent storage to 0 while the receiver still holds it."""
    from rljob_worker.weight_sync import byte_view, ipc_alias

    context = torch.multiprocessing.get_context("spawn")
    inbox, outbox = context.Queue(), context.Queue()
    patched = hasattr(torch.multiprocessing.reductions, "_rebuild_cuda_tensor_original")
    child = context.Process(target=_receiver, args=(inbox, outbox, patched))
    child.start()
    try:
        kept = torch.randn(16 * MiB // 4, device="cuda")  # the trainer's buffer, fp32
        sent = float(kept.double().sum())
        storage = kept.untyped_storage()
        buffer = byte_view(storage, storage.nbytes())
        inbox.put(ipc_alias(buffer) if alias else buffer)
        read = outbox.get(timeout=120)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        storage.resize_(0)  # the params' offload, while the receiver holds its view
        freed = before - torch.cuda.memory_allocated()
        inbox.put("done")
        child.join(timeout=60)
        return read, sent, freed
    finally:
        if child.is_alive():
            child.kill()


def test_an_aliased_buffer_is_read_by_the_receiver_and_leaves_the_senders_storage_unwrapped() -> (
    None
):
    from rljob_worker.weight_sync import byte_view, ipc_alias

    source = torch.arange(8, dtype=torch.float32, device="cuda")
    alias = ipc_alias(byte_view(source.untyped_storage(), 32))
    assert alias.data_ptr() == source.data_ptr()
    assert alias.untyped_storage()._cdata != source.untyped_storage()._cdata
    read, sent, freed = _freed_while_held(alias=True)
    assert read == sent  # the receiver read the sender's bytes
    assert freed == 16 * MiB  # unwrapped: freed at once
    read, sent, wrapped = _freed_while_held(alias=False)
    assert read == sent
    assert wrapped == 0  # sent directly: held in torch's limbo while the receiver holds it
