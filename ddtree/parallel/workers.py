"""Tensor-parallel ranks (parallel/shard.py splits the model): rank 0 runs the engine and its own shard
of the target; every other rank is a worker process that mirrors rank 0's target forwards on its shard.

Rank 0 announces each forward of the target, and each operation on the target's caches (K/V moves,
hybrid state commits), before it runs the same call itself (engine/runner.py): a control message on a
gloo group (the call, with its CPU tensors inside and its device tensors as shapes), then the device
tensors in one buffer broadcast on the device group (NCCL on GPUs). Every rank runs the call on its
shard, so the all-reduces inside the layers meet. Only rank 0's results are used: after the last
all-reduce every rank holds the same hidden states, and rank 0 computes the logits with its whole LM
head; the drafter, the tree, sampling and the scheduler live on rank 0 alone.

A worker that has exited is noticed before the next call; one that dies during a call fails rank 0's
collective at once (its connection drops), and one that hangs after `timeout_s`. Either way rank 0
raises `WorkerError` naming the rank, and the engine is unusable afterwards.
"""
from __future__ import annotations

import dataclasses
import os
import pickle
import socket
import sys
import traceback
import weakref
from contextlib import ExitStack, contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from ddtree.config import EngineConfig, ParallelConfig
from ddtree.parallel.shard import Shard

# How long a rank waits for the others to load their shards, and a worker for rank 0's next call (an idle
# server sends none); a step's collectives wait `ParallelConfig.timeout_s`.
PATIENT_TIMEOUT_S = 7 * 24 * 3600.0


class WorkerError(RuntimeError):
    """A tensor-parallel worker failed: it exited, hung, or lost its connection to rank 0."""


@dataclasses.dataclass(frozen=True)
class _Tensor:
    """A device tensor in a control message: where it lies in the call's byte buffer."""
    offset: int
    nbytes: int
    shape: tuple
    dtype: torch.dtype


@dataclasses.dataclass(frozen=True)
class _Record:
    """A dataclass instance (AttentionBatch, EngineConfig) in a control message, field by field."""
    cls: type
    fields: dict


def _pack(obj, buffers: list, offset: list):
    if isinstance(obj, torch.Tensor):
        if obj.device.type == "cpu":
            return obj
        raw = obj.contiguous().reshape(-1).view(torch.uint8)
        buffers.append(raw)
        offset[0] += raw.numel()
        return _Tensor(offset[0] - raw.numel(), raw.numel(), tuple(obj.shape), obj.dtype)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_pack(x, buffers, offset) for x in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _Record(type(obj), {f.name: _pack(getattr(obj, f.name), buffers, offset)
                                   for f in dataclasses.fields(obj)})
    return obj


def _unpack(obj, buffer: torch.Tensor | None):
    if isinstance(obj, _Tensor):
        return buffer[obj.offset:obj.offset + obj.nbytes].view(obj.dtype).view(obj.shape)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_unpack(x, buffer) for x in obj)
    if isinstance(obj, _Record):
        return obj.cls(**{k: _unpack(v, buffer) for k, v in obj.fields.items()})
    return obj


class _Channel:
    """Rank 0's calls to every rank: a pickled control message on the gloo group `control`, then one
    buffer of the call's device tensors on `step`.

    Workers wait for the next message without limit (an idle server sends none), while rank 0 waits for
    each send only `timeout_s`: a gloo send completes once the receiver takes it, so a hung worker is
    noticed on the first message it does not take."""

    def __init__(self, groups: tuple, device: torch.device, timeout_s: float):
        (self.control, self.step), self.device = groups, device
        self.timeout = timedelta(seconds=timeout_s)

    def send(self, method: str, *args) -> None:
        buffers, offset = [], [0]
        message = pickle.dumps((method, _pack(args, buffers, offset), offset[0]))
        data = torch.frombuffer(bytearray(message), dtype=torch.uint8)
        for t in (torch.tensor([data.numel()]), data):
            dist.broadcast(t, src=0, group=self.control, async_op=True).wait(self.timeout)
        if offset[0]:
            dist.broadcast(torch.cat(buffers), src=0, group=self.step)

    def receive(self) -> tuple[str, tuple]:
        size = torch.empty(1, dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.control)
        data = torch.empty(int(size), dtype=torch.uint8)
        dist.broadcast(data, src=0, group=self.control)
        method, packed, nbytes = pickle.loads(data.numpy().tobytes())
        buffer = None
        if nbytes:
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            dist.broadcast(buffer, src=0, group=self.step)
        return method, _unpack(packed, buffer)


def rank_device(device_type: str, rank: int, pcfg: ParallelConfig) -> torch.device:
    """The device of `rank`: on GPUs, the host's GPU numbered by the rank's place on its node."""
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type, rank % pcfg.ranks_per_node)


def _join(rank: int, pcfg: ParallelConfig, device: torch.device) -> tuple:
    """Joins the ranks' process group (patient: for loading). Returns the gloo group of control
    messages (patient: a worker waits there between calls) and the group of a step's collectives
    (device tensors and the layers' all-reduces), which fail after `timeout_s`."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    patient = timedelta(seconds=PATIENT_TIMEOUT_S)
    device_id = None  # (NCCL: the rank's GPU, with its index)
    if device.type == "cuda":
        device_id = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    dist.init_process_group(backend, init_method=f"tcp://{pcfg.dist_init_addr}", rank=rank,
                            world_size=pcfg.tensor_parallel_size, timeout=patient, device_id=device_id)
    control = dist.new_group(backend="gloo", timeout=patient)
    return control, dist.new_group(backend=backend, timeout=timedelta(seconds=pcfg.timeout_s))


def bind_group(model: torch.nn.Module, group) -> None:
    """Points the model's row-parallel layers and routed experts at the ranks' step group (their outputs
    are all-reduced), and its embedding and LM head where they are split by vocabulary."""
    from ddtree.models.moe import Experts
    from ddtree.models.transformer import RowParallelLinear, VocabParallelEmbedding, VocabParallelLMHead
    split_vocab = model.config.vocab_part is not None
    for module in model.modules():
        if isinstance(module, RowParallelLinear | Experts) or \
                (split_vocab and isinstance(module, VocabParallelEmbedding | VocabParallelLMHead)):
            module.group = group


def serve_rank(rank: int, pcfg: ParallelConfig, model_path: str, device_type: str, dtype: torch.dtype) -> None:
    """A worker's life: join the group, load this rank's shard, then mirror rank 0's calls until "stop"."""
    from ddtree.engine.runner import ModelRunner
    from ddtree.models.loader import load_model
    device = rank_device(device_type, rank, pcfg)
    if device.type == "cpu":  # (the node's cores shared among its ranks)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // pcfg.ranks_per_node))
    else:
        torch.cuda.set_device(device)
    channel = _Channel(_join(rank, pcfg, device), device, pcfg.timeout_s)
    try:
        model, cfg = load_model(model_path, device, dtype, Shard(rank, pcfg.tensor_parallel_size))
        bind_group(model, channel.step)
        dist.barrier()  # (every shard loaded)
        runners: dict[int, ModelRunner] = {}
        bound = None
        graphs = Graphs()
        with torch.inference_mode():
            while True:
                method, args = channel.receive()
                if method == "stop":
                    break
                if method in ("warm_up", "begin_capture", "end_capture", "replay"):
                    getattr(graphs, method)(*args)
                    continue
                if method == "runner":  # a new engine's caches; engines rank 0 dropped are dropped here
                    rid, engine_cfg, live = args
                    for old in [r for r in runners if r not in live]:
                        del runners[old]
                    graphs.keep_only(live)
                    bound = None
                    runners[rid] = ModelRunner(model, cfg, engine_cfg, device, dtype)
                    continue
                rid, *rest = args
                runner = runners[rid]
                graphs.uses(rid)
                if bound != rid:
                    runner.bind_cache()
                    bound = rid
                if method == "forward":
                    model(*rest)
                else:  # move_kv, commit_states, copy_states, logits, embed, all_reduce
                    getattr(runner, method)(*rest)
    except Exception:
        traceback.print_exc(file=sys.stderr)
        sys.stderr.flush()
        os._exit(1)  # (the connection drops: rank 0's next collective fails at once)
    dist.destroy_process_group()


class Graphs:
    """A worker's CUDA graphs: its side of each graph rank 0 captures (engine/graphs.py), by key, with the
    runners (engines) their calls use. They share one memory pool: a worker replays one graph at a time
    and reads none of their outputs. Rank 0's warm-up before a capture runs here under `graphing` too, so
    that the fused ops compile there and not inside the capture."""

    def __init__(self):
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, set[int]]] = {}
        self.pool, self.capturing, self.warming = None, None, None

    def warm_up(self, on: bool) -> None:
        from ddtree.ops.fused import graphing
        if on:
            self.warming = ExitStack()
            self.warming.enter_context(graphing())
        else:
            self.warming.close()

    def begin_capture(self, key: int) -> None:
        from ddtree.ops.fused import graphing
        graph, stack = torch.cuda.CUDAGraph(), ExitStack()
        stack.enter_context(graphing())
        stack.enter_context(torch.cuda.graph(graph, pool=self.pool))
        self.capturing = (key, graph, stack, set())

    def uses(self, runner_id: int) -> None:
        if self.capturing is not None:
            self.capturing[3].add(runner_id)

    def end_capture(self, keep: bool) -> None:
        key, graph, stack, runners = self.capturing
        self.capturing = None
        stack.close()
        if keep:
            self.graphs[key], self.pool = (graph, runners), graph.pool()

    def replay(self, key: int) -> None:
        self.graphs[key][0].replay()

    def keep_only(self, live: list[int]) -> None:
        """Frees the graphs of engines rank 0 has dropped (their caches are gone with them)."""
        for key in [k for k, (_, runners) in self.graphs.items() if not runners <= set(live)]:
            del self.graphs[key]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TensorParallel:
    """Rank 0's side: starts this node's workers, joins the group, and mirrors calls to every rank."""

    def __init__(self, pcfg: ParallelConfig, model_path: str, device: torch.device, dtype: torch.dtype):
        import torch.multiprocessing as mp
        if pcfg.node_rank != 0:
            raise ValueError("rank 0 (the engine) runs on node 0; other nodes run `serve_node`")
        if pcfg.dist_init_addr is None:
            pcfg = dataclasses.replace(pcfg, dist_init_addr=f"127.0.0.1:{free_port()}")
        self.cfg, self.device, self.failed = pcfg, device, None
        ctx = mp.get_context("spawn")
        self.procs = {r: ctx.Process(target=serve_rank, args=(r, pcfg, model_path, device.type, dtype), daemon=True,
                                     name=f"ddtree-tp-rank{r}") for r in range(1, pcfg.ranks_per_node)}
        for p in self.procs.values():
            p.start()
        self._finalizer = weakref.finalize(self, _stop_workers, list(self.procs.values()))
        self.channel = _Channel(_join(0, pcfg, device), device, pcfg.timeout_s)
        self.next_id = 0
        self.runners: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self.next_graph, self.capture_calls = 0, None

    def loaded(self) -> None:
        """Waits until every rank has loaded its shard (rank 0 calls it after loading its own)."""
        with self.guard():
            dist.barrier()

    def add_runner(self, runner, engine_cfg: EngineConfig) -> int:
        """Workers build caches like `runner`'s (`engine_cfg` with its page count); returns its id."""
        rid, self.next_id = self.next_id, self.next_id + 1
        self.runners[rid] = runner
        self.call("runner", rid, engine_cfg, sorted(self.runners))
        return rid

    def call(self, method: str, *args) -> None:
        if self.capture_calls is not None:
            self.capture_calls += 1
        with self.guard():
            self.channel.send(method, *args)

    def begin_capture(self) -> int:
        """Rank 0 starts capturing a CUDA graph: so do the workers, and the calls until `end_capture` (their
        broadcasts and all-reduces) go into their graphs as into rank 0's. Returns the graph's key."""
        key, self.next_graph = self.next_graph, self.next_graph + 1
        self.call("begin_capture", key)
        self.capture_calls = 0
        return key

    def end_capture(self) -> bool:
        """Ends the capture on the workers; False if no call was captured (they keep no graph then)."""
        calls, self.capture_calls = self.capture_calls, None
        self.call("end_capture", calls > 0)
        return calls > 0

    @contextmanager
    def guard(self):
        """Turns a failed collective, or a worker found dead, into a WorkerError naming the rank."""
        if self.failed is not None:
            raise self.failed
        self._check_alive()
        try:
            yield
        except WorkerError:
            raise
        except Exception as e:  # noqa: BLE001 (the backends raise RuntimeError and its subclasses)
            self._check_alive(grace_s=2.0)
            self.failed = WorkerError(f"tensor parallelism failed: a collective among the ranks failed ({e}); "
                                      "a worker on another node may have exited or hung")
            raise self.failed from e

    def _check_alive(self, grace_s: float = 0.0) -> None:
        for rank, p in self.procs.items():
            if grace_s:
                p.join(grace_s)
            if p.exitcode is not None:
                self.failed = WorkerError(f"tensor-parallel worker rank {rank} exited with code {p.exitcode}; "
                                          "see its error above. The engine cannot continue.")
                raise self.failed

    def close(self) -> None:
        """Stops the workers and leaves the group."""
        if self.failed is None and all(p.exitcode is None for p in self.procs.values()):
            try:
                self.channel.send("stop")
            except Exception:  # noqa: BLE001 (shutting down anyway)
                pass
        self._finalizer()
        if dist.is_initialized():
            dist.destroy_process_group()


def _stop_workers(procs: list) -> None:
    for p in procs:
        p.join(5.0)
        if p.exitcode is None:
            p.kill()
            p.join(5.0)


def serve_node(pcfg: ParallelConfig, model_path: str, device_type: str, dtype: torch.dtype) -> None:
    """A node other than node 0: runs its ranks' workers until rank 0 stops them."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    first = pcfg.node_rank * pcfg.ranks_per_node
    procs = [ctx.Process(target=serve_rank, args=(r, pcfg, model_path, device_type, dtype), name=f"ddtree-tp-rank{r}")
             for r in range(first, first + pcfg.ranks_per_node)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    bad = [(p.name, p.exitcode) for p in procs if p.exitcode]
    if bad:
        raise WorkerError(f"tensor-parallel workers failed: {bad}")
