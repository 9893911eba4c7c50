"""One owner of a cluster's lifetime: the store, the pipeline and its supervisor, the runner, the tokenizer.

`open_cluster(config)` loads the tokenizer first (a bad file fails before any
worker starts; a caller that checked a prompt with it passes it in), then
opens the store, the pipeline and the runner, and closes them in reverse
whichever way the block is left (an error, a cancellation by a signal): no
worker outlives it and no run is left marked running. The CLI, the
HTTP app (as its cleanup context) and the tests all open a cluster this way.

An open Cluster's methods are the narrow face the HTTP API reads: whether it
is ready (`health`), runs (`run`, `live`, `latest`, `runs`, `submit`,
`cancel`, `queued`), nodes (`nodes`, `node_views`, `joined`, `restart`) and
the bus. They answer in plain values and the run record types of
coordinator.stats, so a face never reaches past the cluster into the parts
that run it. The errors they raise that a caller tells apart are importable
from here.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from coordinator.events import EventBus
from coordinator.launch.base import BUILD_TIMEOUT, LAUNCHERS, LaunchError, WorkerLauncher, local_env
from coordinator.launch.local import Launcher
from coordinator.plan.calibration import Plan, make_plan
from coordinator.runs.requests import RunRequest
from coordinator.runs.resume import Identity
from coordinator.runs.runner import MAX_ACTIVE, RunFinishedError, Runner
from coordinator.stages.client import WorkerError
from coordinator.stages.join import JoinListener
from coordinator.stages.node import Node, NodeState
from coordinator.stages.pipeline import FORWARD_TIMEOUT, RECOVER_TIMEOUT, Pipeline, StageFailed, Supervision
from coordinator.stages.supervisor import attach_pipeline, launch_pipeline
from coordinator.stats import ClusterRun
from coordinator.store.history import MEMORY, RunStore, StoreError
from coordinator.units import quiet
from workers.models import ModelSpecError, default_precision, describe, tokenizer_path
from workers.protocol.info import ModelInfo
from workers.protocol.report import LayerRange

if TYPE_CHECKING:
    from workers.models.tokenizer import Tokenizer

# Re-exported from the parts below: the errors the face raises that callers tell apart, the node states.
__all__ = [
    "Cluster",
    "ClusterConfig",
    "Health",
    "NodeState",
    "RestartFailed",
    "RunFinishedError",
    "StoreError",
    "model_tokenizer",
    "node_view",
    "open_cluster",
    "plan_stages",
]


@dataclass(frozen=True)
class ClusterConfig:
    """What cluster to open.

    model: the model spec (see workers.models).
    stages: worker processes to launch, one per contiguous range of layers.
    precision: the launched workers' weight precision; "" for the model's default
        (workers.models.default_precision: packed for a GGUF file, else f32).
    plan: how to split the layers: "even", or "measured" (each layer timed at
        decode in `precision` first, then the slowest stage made as fast as it
        can be; see coordinator.plan.calibration).
    ranges: the split to launch when already planned (then `plan` is not used).
    db: the run history file, or ":memory:" to keep nothing.
    attach: addresses of workers already running elsewhere, in pipeline order;
        when given, nothing is launched.
    join: HOST:PORT to listen on for workers that join (see coordinator.stages.join);
        when given, nothing is launched and the stages wait for them.
    join_objective: what the first plan of workers that measured themselves minimizes
        ("latency" or "throughput", coordinator.plan.placement), or "even": split evenly (or
        by memory) in join order whatever they measured (coordinator.plan.place.JOIN_PLANS).
    worker_token: the token attached or joining workers were started with
        (launched workers get a fresh one).
    forward_timeout: seconds a stage may take per forward.
    recover_timeout: seconds a run whose stage went down waits for it to be back (0: it fails at once).
    build_timeout: seconds a launched worker may take to build and report.
    max_active: runs executing at once (their decode steps batched into shared forwards).
    progress: told, in words, what is happening while the cluster opens.
    launcher: how launched workers come to exist: "local" subprocesses, or "ray" actors.
    ray_address: the Ray cluster to place them on ("auto", HOST:PORT); "" starts a local instance.
    ray_strategy: how Ray spreads the stages over its nodes: SPREAD, STRICT_SPREAD or PACK.
    ray_cpus: CPUs Ray reserves for each stage.
    chat_template: a Jinja chat template file to use instead of the model file's own ("" for that
        one); a model whose file has none takes no chat without it.
    resume: take over the runs a coordinator that died left queued or running on the same `db`, when
        they ran this model and plan (False: mark them interrupted; see coordinator.runs.resume).
    """

    model: str
    stages: int = 1
    precision: str = ""
    plan: str = "even"
    ranges: tuple[LayerRange, ...] = ()
    db: str | Path = MEMORY
    attach: tuple[str, ...] = ()
    join: str = ""
    join_objective: str = "latency"
    worker_token: str = ""
    forward_timeout: float = FORWARD_TIMEOUT
    recover_timeout: float = RECOVER_TIMEOUT
    build_timeout: float = BUILD_TIMEOUT
    max_active: int = MAX_ACTIVE
    progress: Callable[[str], None] = quiet
    launcher: str = "local"
    ray_address: str = ""
    ray_strategy: str = "SPREAD"
    ray_cpus: float = 1.0
    chat_template: str | Path = ""
    resume: bool = True


class RestartFailed(Exception):
    """A node could not be restarted (its workers were attached, or the new one did not come up)."""


class Health(msgspec.Struct, kw_only=True):
    """Whether a run can go through now, and every reason it cannot.

    ok: no reason. reasons: "part: why" for each part not ready (the store, the
    run loop, the stages, each stage not up named). nodes_up: stages up.
    nodes: stages in all. store: why the store cannot write, or "ok".
    """

    ok: bool
    reasons: list[str]
    nodes_up: int
    nodes: int
    store: str


@dataclass(frozen=True)
class Cluster:
    """An open cluster: the model it runs and the parts that run it (`joins`: where workers join, if any)."""

    info: ModelInfo
    store: RunStore
    pipeline: Pipeline
    runner: Runner
    tokenizer: Tokenizer | None
    joins: JoinListener | None = None

    @property
    def bus(self) -> EventBus:
        """The cluster's one event bus: the pipeline's, which the runner publishes to as well."""
        return self.pipeline.bus

    @property
    def supervisor(self) -> Supervision:
        """What keeps the stages' workers alive (restarts them, when it launched them)."""
        return self.pipeline.supervisor

    def health(self) -> Health:
        """Whether a run can go through now; when not, why, part by part."""
        store = self.store.problem
        problems = {"store": store, "run loop": self.runner.problem, "stages": self.pipeline.unready()}
        reasons = [f"{part}: {why}" for part, why in problems.items() if why is not None]
        nodes = self.pipeline.nodes
        up = sum(n.state == "up" for n in nodes)
        return Health(ok=not reasons, reasons=reasons, nodes_up=up, nodes=len(nodes), store=store or "ok")

    async def submit(self, req: RunRequest) -> ClusterRun:
        """Queue a run; its record as stored (ValueError: the model cannot take it; Unavailable: not now)."""
        return await self.runner.submit(req)

    def queued(self) -> int:
        """Runs waiting to start."""
        return self.runner.queued()

    async def cancel(self, run_id: int) -> ClusterRun:
        """Cancel a queued or running run; it as stored once stopped (LookupError, RunFinishedError)."""
        return await self.runner.cancel(run_id)

    def live(self, run_id: int) -> ClusterRun | None:
        """The live record of run `run_id` while it runs, else None."""
        return self.runner.live(run_id)

    async def run(self, run_id: int, with_output: bool = False) -> ClusterRun | None:
        """Run `run_id`: the live record while it runs, else the stored one, else None (StoreError)."""
        if (live := self.runner.live(run_id)) is not None:
            return live
        return await self.store.get(run_id, with_output=with_output)

    async def latest(self, with_output: bool = False) -> ClusterRun | None:
        """The run started last: live while it runs, else as stored (its output on request); None yet."""
        run = self.runner.latest
        if run is not None and with_output and run.status != "running":
            run = await self.store.get(run.id, with_output=True) or run
        return run

    async def runs(self, limit: int, before: int | None = None) -> list[ClusterRun]:
        """Up to `limit` runs with ids below `before`, newest first, live records for those running."""
        stored = await self.store.list(limit=limit, before=before)
        live = {run.id: run for run in self.runner.running()}
        return [live.get(r.id, r) for r in stored]

    @property
    def node_count(self) -> int:
        """Stages in the pipeline: nodes are 0..node_count - 1."""
        return len(self.pipeline.nodes)

    def node_views(self) -> list[dict]:
        """Every node as served, in pipeline order: its report (or only its layers) and its state."""
        return [node_view(n) for n in self.pipeline.nodes]

    async def nodes(self, live_within: float | None = None) -> list[dict]:
        """The node views; with `live_within` seconds, each with what its worker says now, under "live"."""
        views = self.node_views()
        if live_within is not None:
            lives = await asyncio.gather(*(_live(n, live_within) for n in self.pipeline.nodes))
            for view, said in zip(views, lives, strict=True):
                view["live"] = said
        return views

    def joined(self) -> dict | None:
        """With workers that join: who has joined, spares included, and why the plan waits; else None."""
        return self.joins.view() if self.joins is not None else None

    async def restart(self, index: int) -> dict:
        """Restart node `index` (0..node_count - 1) now; its view once up, else RestartFailed saying why.

        Concurrent calls for one node share one restart and all get its outcome;
        an index outside the pipeline is an IndexError.
        """
        try:
            node = await self.supervisor.restart(index)
        except (StageFailed, LaunchError, WorkerError, OSError) as exc:
            raise RestartFailed(str(exc)) from exc
        return node_view(node)


def node_view(node: Node) -> dict:
    """A node as served: its NodeReport (its layers alone while no worker holds it) plus live state."""
    held = node.report if node.report is not None else {"layers": node.layers}
    view = msgspec.to_builtins(held)
    view.update(stage=node.index, state=node.state, restarts=node.restarts, error=node.error)
    view["restarts_in_window"] = node.restarts_in_window
    return view


async def _live(node: Node, timeout: float) -> dict:
    """What a node's worker says of itself now (resident set, sessions, forwards, KV bytes), or why not.

    timeout: seconds the worker has to answer.
    """
    if node.state != "up" or node.client is None:
        return {"error": f"node is {node.state}"}
    try:
        stats = await node.client.stats(timeout=timeout)
    except WorkerError as exc:
        return {"error": str(exc)}
    return {
        "resident_bytes": stats.resident_bytes,
        "sessions": stats.sessions,
        "forwards": stats.forwards,
        "kv_bytes": stats.kv_bytes,
        "kv_session_bytes": stats.kv_session_bytes,
    }


@asynccontextmanager
async def open_cluster(config: ClusterConfig, tokenizer: Tokenizer | None = None) -> AsyncIterator[Cluster]:
    """Open the store, the pipeline and the runner; close them in reverse order on the way out.

    tokenizer: the model's (`model_tokenizer`), when the caller has loaded it already; else loaded here.

    A bad model spec, split or tokenizer file raises before anything is opened
    (ModelSpecError, PlanError), a store that cannot be used (StoreError)
    before any worker starts, workers that fail to start or answer
    (LaunchError, WorkerError, StageFailed) after the store is closed again.
    """
    info = describe(config.model)
    if not config.precision:
        config = replace(config, precision=default_precision(config.model))
    if config.attach and config.join:
        raise ValueError("attach to workers or let them join, not both")
    if config.launcher not in LAUNCHERS:
        raise ValueError(f"launcher {config.launcher!r} is unknown; use one of {', '.join(LAUNCHERS)}")
    if config.launcher != "local" and (config.attach or config.join):
        raise ValueError(f"the {config.launcher} launcher starts workers: not with attached or joining ones")
    if info.input != "tokens":
        if config.chat_template:
            raise ValueError(f"model {config.model!r} takes no prompt, so no chat template")
        tokenizer = None
    elif tokenizer is None:
        tokenizer = model_tokenizer(config.model, config.chat_template)
    plan = Plan([]) if config.attach else await plan_stages(config, info)
    ranges = plan.ranges
    async with AsyncExitStack() as stack:
        store = await RunStore.open(config.db, takes_over=config.resume)
        stack.push_async_callback(store.close)
        joins = None
        if config.join:
            joins = await JoinListener.open(
                config.join, info, config.stages, config.worker_token,
                config.forward_timeout, config.build_timeout, config.progress,
                plan.costs.layers if plan.costs else (), config.precision, config.join_objective,
            )  # fmt: skip
            pipeline = joins.pipeline
        elif config.attach:
            config.progress(f"attaching to {','.join(config.attach)}")
            addrs, token = list(config.attach), config.worker_token
            pipeline = await attach_pipeline(info, addrs, token, config.forward_timeout)
        else:
            split_text = ", ".join(map(str, ranges))
            config.progress(f"launching {len(ranges)} worker(s) for {config.model}: {split_text}")
            launcher = await _launcher(config, stack)
            pipeline = await launch_pipeline(launcher, info, ranges, config.forward_timeout, config.progress)
        stack.push_async_callback(pipeline.close)
        pipeline.recover_timeout = config.recover_timeout
        if joins is not None:
            stack.push_async_callback(joins.close)  # before the pipeline: let the workers go first
        identity = Identity.of(config.model, config.precision, [node.layers for node in pipeline.nodes])
        runner = Runner(
            pipeline, store, tokenizer, max_active=config.max_active, identity=identity, resume=config.resume
        )
        await runner.start()
        stack.push_async_callback(runner.close)
        yield Cluster(info, store, pipeline, runner, tokenizer, joins)


async def _launcher(config: ClusterConfig, stack: AsyncExitStack) -> WorkerLauncher:
    """The launcher `config.launcher` names, ready to start workers; what it holds is released by `stack`."""
    if config.launcher == "local":
        return Launcher(config.model, config.precision, build_timeout=config.build_timeout)
    try:
        from coordinator.launch.ray import RayLauncher  # Ray is an optional extra
    except ImportError as exc:
        raise ValueError(f"--launcher ray needs Ray ({exc}): pip install 'rlx-cluster[ray]'") from None
    launcher = RayLauncher(
        config.model, config.precision, address=config.ray_address, strategy=config.ray_strategy,
        cpus=config.ray_cpus, build_timeout=config.build_timeout,
    )  # fmt: skip
    await launcher.connect()
    stack.push_async_callback(launcher.close)
    return launcher


async def plan_stages(config: ClusterConfig, info: ModelInfo) -> Plan:
    """The split to launch: the config's ranges, else its plan's (a measured plan times the layers first)."""
    if config.ranges:
        return Plan(list(config.ranges))
    env = local_env(config.stages)
    return await make_plan(config.plan, config.model, info.n_layers, config.stages, config.precision, env,
                           timeout=config.build_timeout, progress=config.progress, db=config.db)  # fmt: skip


def model_tokenizer(model: str, chat_template: str | Path = "") -> Tokenizer:
    """The tokenizer of a language model's GGUF file (~0.4 s for SmolLM2's).

    chat_template: a Jinja template file to chat through instead of the model file's own.
    """
    # Imported here: the tokenizers library is only needed by language models.
    from workers.models.tokenizer import load_tokenizer

    path = tokenizer_path(model)
    if path is None:
        raise ModelSpecError(
            f"model {model!r} takes tokens but names no GGUF file to read its tokenizer from"
        )
    if not chat_template:
        return load_tokenizer(path)
    try:
        text = Path(chat_template).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ValueError(f"chat template {chat_template}: cannot read it ({why})") from None
    return load_tokenizer(path, text, template_name=str(chat_template))
