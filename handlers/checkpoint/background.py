"""Saves written behind training (``Checkpointer(asynchronous=True)``, ``--async-checkpoint``):
the copy the step waits for, and the one thread that writes and commits behind it.

``StagedCopies`` copies a checkpoint's payload into CPU memory, so that the next steps may
change the live tensors while the copy is written; its buffers are kept from one save to the
next (the copy into memory already mapped is several times faster than into new memory), at
the cost of one copy of the state held in CPU memory for the run. ``Background`` runs one job
at a time on a thread of its own: a new save first waits for the one in flight, so the saves
commit in order and a buffer is never refilled while its previous contents are being
written. A job's exception is raised by ``wait()``, on the training thread, where a
synchronous save would have raised it.
"""

from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import nn

_CONTAINERS = (dict, OrderedDict, list, tuple, set)
Buffers = dict[tuple, torch.UntypedStorage]  # by (device, address, size) of the source storage
Views = dict[tuple, torch.Tensor]  # by source storage, dtype, offset, size, stride and type


class StagedCopies:
    """Copies of checkpoint payloads into CPU memory, in buffers (and the tensors viewing
    them) reused from save to save."""

    def __init__(self) -> None:
        self._buffers: Buffers = {}
        self._views: Views = {}

    def copy(self, payload: Any) -> Any:
        """A copy of ``payload`` that training cannot change: each tensor's storage copied
        once into CPU memory (tensors that share a storage, as tied weights do, share its
        copy, so the file holds what ``torch.save`` of the live state would), the dicts,
        lists, tuples and sets around them rebuilt. Everything else a checkpoint may hold
        (numbers, strings, ``None``, ``torch.Size``, dtypes) is immutable and kept as it is.
        The copy is valid until the next ``copy``, which refills its buffers; those no
        tensor of this payload used are freed."""
        buffers: Buffers = {}
        views: Views = {}
        copied = self._copy(payload, buffers, views)
        self._buffers, self._views = buffers, views
        return copied

    def _copy(self, value: Any, buffers: Buffers, views: Views) -> Any:
        if isinstance(value, torch.Tensor):
            return self._copy_tensor(value, buffers, views)
        if type(value) in _CONTAINERS:
            if isinstance(value, dict):
                return type(value)((key, self._copy(item, buffers, views))
                                   for key, item in value.items())
            return type(value)(self._copy(item, buffers, views) for item in value)
        return value

    def _copy_tensor(self, tensor: torch.Tensor, buffers: Buffers, views: Views
                     ) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = (storage.device, storage.data_ptr(), storage.nbytes())
        if key not in buffers:
            # Two live storages never share an address, so a buffer kept under this key is
            # free to refill, whichever storage it copied before.
            buffer = self._buffers.get(key)
            if buffer is None:
                buffer = torch.UntypedStorage(storage.nbytes(), device="cpu")
            buffer.copy_(storage)  # from a GPU: waits for the device, then copies
            buffers[key] = buffer
        shape = (key, tensor.dtype, tensor.storage_offset(), tuple(tensor.size()),
                 tensor.stride(), type(tensor))
        if shape in views:  # tied weights: a tensor of its own, as the state dict has
            return _view(tensor, buffers[key])
        views[shape] = self._views.get(shape)
        if views[shape] is None:
            views[shape] = _view(tensor, buffers[key])
        return views[shape]


def _view(tensor: torch.Tensor, buffer: torch.UntypedStorage) -> torch.Tensor:
    """A tensor over ``buffer`` shaped as ``tensor`` is over its storage."""
    view = torch.empty(0, dtype=tensor.dtype).set_(buffer, tensor.storage_offset(),
                                                   tensor.size(), tensor.stride())
    if isinstance(tensor, nn.Parameter):
        return nn.Parameter(view, requires_grad=tensor.requires_grad)
    return view


class Background:
    """One job at a time on one worker thread, started with the first job and reused (a
    thread started for every save would hold the step until it runs). Python joins the
    worker at the exit, so a job still running when a process ends early (a run stopped by
    another error) is finished and committed; a kill cuts it off, which the commit protocol
    survives."""

    def __init__(self) -> None:
        self._worker: ThreadPoolExecutor | None = None
        self._job: Future | None = None

    @property
    def busy(self) -> bool:
        """Whether a job was started and not yet waited for."""
        return self._job is not None

    def start(self, job: Callable[[], None]) -> None:
        """Run ``job()`` on the worker thread; a job already started must be waited for first."""
        if self._job is not None:
            raise RuntimeError("a checkpoint is still being written: wait() for it first")
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1,
                                              thread_name_prefix="checkpoint-writer")
        self._job = self._worker.submit(job)

    def wait(self) -> None:
        """Block until the job is done and raise what it raised; at once when none runs."""
        job, self._job = self._job, None
        if job is not None:
            job.result()
