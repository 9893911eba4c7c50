"""One owner of a cluster's lifetime: the store, the pipeline, the runner and the tokenizer.

`open_cluster(config)` loads the tokenizer first (a bad file fails before any
worker starts; a caller that checked a prompt with it passes it in), then
opens the store, the pipeline and the runner, and closes them in reverse
whichever way the block is left (an error, a cancellation by a signal): no
worker outlives it and no run is left marked running. The CLI, the
HTTP app (as its cleanup context) and the tests all open a cluster this way.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from coordinator.events import EventBus
from coordinator.launch.base import BUILD_TIMEOUT, LAUNCHERS, WorkerLauncher
from coordinator.launch.local import Launcher
from coordinator.plan.calibration import Plan, make_plan, worker_env
from coordinator.runs.runner import MAX_ACTIVE, Runner
from coordinator.stages.join import JoinListener
from coordinator.stages.pipeline import FORWARD_TIMEOUT, Pipeline
from coordinator.store.history import MEMORY, RunStore
from coordinator.units import quiet
from workers.models import default_precision, describe, gguf_path
from workers.protocol.info import ModelInfo
from workers.protocol.report import LayerRange

if TYPE_CHECKING:
    from workers.models.tokenizer import Tokenizer


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
    worker_token: the token attached or joining workers were started with
        (launched workers get a fresh one).
    forward_timeout: seconds a stage may take per forward.
    build_timeout: seconds a launched worker may take to build and report.
    max_active: runs executing at once (their decode steps batched into shared forwards).
    progress: told, in words, what is happening while the cluster opens.
    launcher: how launched workers come to exist: "local" subprocesses, or "ray" actors.
    ray_address: the Ray cluster to place them on ("auto", HOST:PORT); "" starts a local instance.
    ray_strategy: how Ray spreads the stages over its nodes: SPREAD, STRICT_SPREAD or PACK.
    ray_cpus: CPUs Ray reserves for each stage.
    """

    model: str
    stages: int = 1
    precision: str = ""
    plan: str = "even"
    ranges: tuple[LayerRange, ...] = ()
    db: str | Path = MEMORY
    attach: tuple[str, ...] = ()
    join: str = ""
    worker_token: str = ""
    forward_timeout: float = FORWARD_TIMEOUT
    build_timeout: float = BUILD_TIMEOUT
    max_active: int = MAX_ACTIVE
    progress: Callable[[str], None] = quiet
    launcher: str = "local"
    ray_address: str = ""
    ray_strategy: str = "SPREAD"
    ray_cpus: float = 1.0


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
        tokenizer = None
    elif tokenizer is None:
        tokenizer = model_tokenizer(config.model)
    plan = Plan([]) if config.attach else await plan_stages(config, info)
    ranges = plan.ranges
    async with AsyncExitStack() as stack:
        store = await RunStore.open(config.db)
        stack.push_async_callback(store.close)
        joins = None
        if config.join:
            joins = await JoinListener.open(
                config.join, info, config.stages, config.worker_token,
                config.forward_timeout, config.build_timeout, config.progress,
                plan.costs.layers if plan.costs else (),
            )  # fmt: skip
            pipeline = joins.pipeline
        elif config.attach:
            config.progress(f"attaching to {','.join(config.attach)}")
            addrs, token = list(config.attach), config.worker_token
            pipeline = await Pipeline.attach(info, addrs, token, config.forward_timeout)
        else:
            split_text = ", ".join(map(str, ranges))
            config.progress(f"launching {len(ranges)} worker(s) for {config.model}: {split_text}")
            launcher = await _launcher(config, stack)
            pipeline = await Pipeline.launch(launcher, info, ranges, config.forward_timeout, config.progress)
        stack.push_async_callback(pipeline.close)
        if joins is not None:
            stack.push_async_callback(joins.close)  # before the pipeline: let the workers go first
        runner = Runner(pipeline, store, tokenizer, max_active=config.max_active)
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
    env = worker_env(config.model, config.precision, config.stages)
    return await make_plan(config.plan, config.model, info.n_layers, config.stages, config.precision, env,
                           timeout=config.build_timeout, progress=config.progress, db=config.db)  # fmt: skip


def model_tokenizer(model: str) -> Tokenizer:
    """The tokenizer of a language model's GGUF file (~0.4 s for SmolLM2's)."""
    # Imported here: the tokenizers library is only needed by language models.
    from workers.models.tokenizer import load_tokenizer

    path = gguf_path(model)
    assert path is not None, f"model {model!r} takes tokens but names no GGUF file"
    return load_tokenizer(path)
