"""A process group outside ``torch.distributed``'s default world: the trainer ranks and the
rollout ranks of a disaggregated job (``rollout.placement=disaggregated``) each have a default
group of their own, and this group joins both (vLLM's ``StatelessProcessGroup`` and slime's
weight-update group play the same part).

It is a gloo backend built straight on the job's ``TCPStore`` (under a key prefix of its own)
and used through the backend's own calls, so no rank of either world has to create it
collectively and the default groups never learn of it. Tensors go through host memory (gloo);
CUDA tensors are staged on the host.
"""

from __future__ import annotations

import datetime
import pickle

import torch
import torch.distributed as dist


class StatelessGroup:
    """Ranks ``0 .. size - 1`` over ``store`` (prefixed with ``prefix``); ``rank`` is this
    process's rank in the group (not its default-group rank).

    Every method is collective over the whole group except :meth:`start_exchange` (point to point)
    and the flags (:meth:`raise_flag`, :meth:`flag_raised`: keys in the store, polled).
    """

    def __init__(self, store, rank: int, size: int, prefix: str = "stateless", timeout_minutes: float = 60):
        self.rank, self.size = rank, size
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size,
                                        datetime.timedelta(minutes=timeout_minutes))
        self.flags = dist.PrefixStore(f"{prefix}/flags", store)

    def raise_flag(self, name: str) -> None:
        """Set flag ``name`` for every rank to see (not collective: the ranks that look for it poll
        :meth:`flag_raised` between their own steps)."""
        self.flags.set(name, b"1")

    def flag_raised(self, name: str) -> bool:
        """Whether some rank raised flag ``name`` (does not wait)."""
        return self.flags.check([name])

    def broadcast_object(self, obj, src: int):
        """``obj`` of rank ``src`` (pickled), returned on every rank (``obj`` is ignored elsewhere)."""
        data = pickle.dumps(obj) if self.rank == src else b""
        n = torch.tensor([len(data)], dtype=torch.int64)
        self.pg.broadcast(n, src).wait()
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == src else \
            torch.empty(int(n), dtype=torch.uint8)
        if int(n):
            self.pg.broadcast(buf, src).wait()
        return obj if self.rank == src else pickle.loads(buf.numpy().tobytes())

    def all_gather_object(self, obj) -> list:
        """Every rank's ``obj`` (pickled), indexed by group rank."""
        data = pickle.dumps(obj)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        self.pg.allgather([sizes], [torch.tensor([len(data)], dtype=torch.int64)]).wait()
        longest = max(int(s) for s in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.size)]
        self.pg.allgather([out], [mine]).wait()
        return [pickle.loads(o[: int(s)].numpy().tobytes()) for o, s in zip(out, sizes)]

    def start_exchange(self, send: dict[int, torch.Tensor], recv: dict[int, torch.Tensor]):
        """Start sending ``send[peer]`` to each peer and receiving into ``recv[peer]`` from each
        peer, all at once; returns ``finish()``, which waits until every transfer is done. Tensors
        must be contiguous; the two sides of a transfer agree on its element count and dtype (one
        message per pair and direction)."""
        staged = {p: t.cpu() if t.is_cuda else t for p, t in recv.items()}
        works = [self.pg.send([(t.cpu() if t.is_cuda else t).contiguous()], p, 0) for p, t in send.items()]
        works += [self.pg.recv([t], p, 0) for p, t in staged.items()]

        def finish() -> None:
            for w in works:
                w.wait()
            for p, t in recv.items():
                if t.is_cuda:
                    t.copy_(staged[p])

        return finish

    def barrier(self) -> None:
        """Wait until every rank of the group is here."""
        self.all_gather_object(None)
