"""`tokenloop serve --replicas N`: N engine replicas as a Ray Serve deployment behind one OpenAI-compatible ingress.

The ingress deployment runs the same app as a single engine's server (server/app.py) over a ReplicaSetClient
(scale_out/client.py); the replicas' deployment (scale_out/replica.py) carries the router (scale_out/routers.py)
and reports its cache to it every ROUTING_STATS_PERIOD_S. Engine flags apply to each replica; each replica asks Ray
for as many CPUs as it runs threads (--threads, else this machine's cores shared out). A local Ray instance is
started unless --ray-address names one to join. SIGTERM (or Ctrl-C) shuts Serve down: each replica finishes
its requests first (Serve's graceful shutdown), then Ray stops.
"""

from __future__ import annotations

import logging
import signal
import threading
from dataclasses import dataclass, replace

from ray import serve

from tokenloop.engine.config import EngineConfig
from tokenloop.scale_out.client import ReplicaSetClient
from tokenloop.scale_out.replica import EngineReplica, replica_threads
from tokenloop.scale_out.routers import ROUTERS
from tokenloop.server.app import build_app
from tokenloop.server.serve import ServerConfig

logger = logging.getLogger(__name__)
APP_NAME = "tokenloop"
ROUTING_STATS_PERIOD_S = 0.5


@dataclass(frozen=True, slots=True)
class ReplicaConfig:
    replicas: int
    router: str = "prefix"  # scale_out/routers.py's ROUTERS
    ray_address: str | None = None  # None: start a local Ray instance

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {self.router!r}")


@serve.ingress()
class Ingress:
    def __init__(self, replicas, engine_config: EngineConfig, server: ServerConfig, router: str) -> None:
        self.engine_config, self.server = engine_config, server
        self.client = ReplicaSetClient(engine_config, replicas, server.limits, router)

    def __serve_build_asgi_app__(self):
        s = self.server
        return build_app(self.client, s.model_name, s.api_key, s.max_n, s.max_body_mb, self.engine_config.lora_modules)


def build_application(engine_config: EngineConfig, server: ServerConfig, config: ReplicaConfig):
    from ray.serve.config import RequestRouterConfig

    threads = replica_threads(engine_config, config.replicas)
    engine_config = replace(engine_config, threads=threads)
    replicas = serve.deployment(
        EngineReplica,
        name="engine",
        num_replicas=config.replicas,
        ray_actor_options={"num_cpus": threads},
        max_ongoing_requests=server.limits.max_waiting + engine_config.max_num_seqs,
        request_router_config=RequestRouterConfig(
            request_router_class=ROUTERS[config.router],
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
            request_routing_stats_timeout_s=10 * ROUTING_STATS_PERIOD_S,
        ),
    )
    ingress = serve.deployment(Ingress, name="ingress", ray_actor_options={"num_cpus": 0})
    return ingress.bind(replicas.bind(engine_config, server.limits), engine_config, server, config.router)


def serve_replicas(engine_config: EngineConfig, server: ServerConfig, config: ReplicaConfig) -> None:
    import ray

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ray.init(address=config.ray_address, include_dashboard=False)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # after ray.init, whose own handlers would end the process at once
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": server.host, "port": server.port})
        serve.run(build_application(engine_config, server, config), name=APP_NAME, route_prefix="/")
        logger.info(
            "serving on http://%s:%d with %d replicas (%s router)",
            server.host,
            server.port,
            config.replicas,
            config.router,
        )
        stop.wait()
        logger.info("shutting down: the replicas finish their requests")
        serve.shutdown()
    finally:
        ray.shutdown()
