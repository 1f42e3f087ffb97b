"""A do-nothing ext_proc server: the floor that inferlb's picker is measured against.

It answers every request with a prebuilt reply that names the pool's endpoints in turn, without reading
headers or body: what remains is the cost of grpc.aio stream handling, which no Python picker can avoid. Its
gRPC threads yield to its event loop as inferlb's do (`inferlb.threads`), so that the floor keeps what any Python
picker can save.
Run as ``python -m inferlb.bench.noop_picker --config picker.yaml`` (the picker's own config file).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import signal
from collections.abc import AsyncIterator

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest, ProcessingResponse
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from inferlb.filter.replies import CONTINUE, RouteReplies
from inferlb.scorer.config import load_config
from inferlb.scorer.pool import Pool
from inferlb.threads import batch_other_threads


class NoopService(external_processor_pb2_grpc.ExternalProcessorServicer):
    def __init__(self, pool: Pool) -> None:
        replies = RouteReplies(pool)
        self._headers = itertools.cycle(replies.headers)
        self._body = itertools.cycle(replies.body)

    async def Process(
        self, request_iterator: AsyncIterator[ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ProcessingResponse]:
        async for message in request_iterator:
            kind = message.WhichOneof("request")
            if kind == "request_headers":
                if message.request_headers.end_of_stream or not message.protocol_config.request_body_mode:
                    yield next(self._headers)
                else:
                    yield CONTINUE[kind]
            elif kind == "request_body":
                yield next(self._body)
            elif kind in CONTINUE:
                yield CONTINUE[kind]


async def _serve(config_path: str) -> None:
    config = load_config(config_path)
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(NoopService(Pool(config.endpoints)), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    server.add_insecure_port(config.listen)
    await server.start()
    batch_other_threads()
    await health_servicer.set("readiness", health_pb2.HealthCheckResponse.SERVING)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True)
    asyncio.run(_serve(parser.parse_args().config))


if __name__ == "__main__":
    main()
