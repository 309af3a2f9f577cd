"""The balancer's two HTTP apps: the client port (OpenAI API, /health, /metrics,
/admin/status) and the peer listener (forwarded requests only). Routes and middleware
order only; a request's intake is :class:`~skymesh.balancer.request_intake.RequestIntake`'s."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest

from skymesh.balancer.gate import ClientGate
from skymesh.balancer.metrics import BalancerMetrics
from skymesh.balancer.middleware import make_error_middleware
from skymesh.balancer.request_intake import RequestIntake


class HttpSurface:
    def __init__(self, *, intake: RequestIntake, gate: ClientGate, metrics: BalancerMetrics,
                 max_body_bytes: int, model: Callable[[], str], admin_status: Callable[[], dict[str, Any]],
                 draining: Callable[[], bool] = lambda: False) -> None:
        self.intake = intake
        self._draining = draining
        self.gate = gate
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self._model = model
        self._admin_status = admin_status

    def client_app(self) -> web.Application:
        """The client port: the gate checks every caller (client keys, admin token, body
        bounds) before a handler runs; errors leave as OpenAI-shaped JSON."""
        app = web.Application(client_max_size=self.max_body_bytes,
                              middlewares=[make_error_middleware(self.metrics), self.gate.middleware])
        self._add_inference_routes(app)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/admin/status", self._admin)
        return app

    def peer_app(self, bind: Any) -> web.Application:
        """The peer listener: ``bind`` (peer_listener.make_binding_middleware) ties the
        claimed origin to the sender's certificate, then the gate checks the peer token."""
        app = web.Application(client_max_size=self.max_body_bytes,
                              middlewares=[make_error_middleware(self.metrics), bind, self.gate.peer_middleware])
        self._add_inference_routes(app)
        return app

    def _add_inference_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self.intake.handle(request, "completions")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self.intake.handle(request, "chat")

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": self._model(), "object": "model", "created": 0, "owned_by": "skymesh"}]}
        )

    async def _health(self, request: web.Request) -> web.Response:
        # a draining balancer fails its health check while it still serves: the load
        # balancer in front (an NLB's target group, the local entry) stops sending it new
        # connections before its listener closes (Balancer.stop, drain_listen_s)
        if self._draining():
            return web.Response(status=503, text="draining")
        return web.Response(text="ok")

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4})

    async def _admin(self, request: web.Request) -> web.Response:
        return web.json_response(self._admin_status())
