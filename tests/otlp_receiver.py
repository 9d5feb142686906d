"""A real OTLP/HTTP trace receiver for tests: decodes ExportTraceServiceRequest protobufs."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest, ExportTraceServiceResponse,
)

KINDS = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def _attrs(kvs) -> dict:
    return {kv.key: _value(kv.value) for kv in kvs}


class OTLPReceiver:
    """OTLP/HTTP on `endpoint`; with grpc=True also OTLP/gRPC on `grpc_endpoint`."""

    def __init__(self, grpc: bool = False) -> None:
        self.spans: list[dict] = []
        self.lock = threading.Lock()
        self.grpc_server = self._start_grpc() if grpc else None
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                req = ExportTraceServiceRequest()
                req.ParseFromString(body)
                receiver._add(req)
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _start_grpc(self):
        from concurrent import futures

        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

        receiver = self

        class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):  # noqa: N802
                receiver._add(request)
                return ExportTraceServiceResponse()

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        self.grpc_endpoint = f"http://127.0.0.1:{port}"
        return server

    def _add(self, req: ExportTraceServiceRequest) -> None:
        out = []
        for rs in req.resource_spans:
            resource = _attrs(rs.resource.attributes)
            for ss in rs.scope_spans:
                for s in ss.spans:
                    out.append({
                        "trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
                        "parent_span_id": s.parent_span_id.hex() or None, "name": s.name, "kind": KINDS[s.kind],
                        "start_ns": s.start_time_unix_nano, "end_ns": s.end_time_unix_nano,
                        "attributes": _attrs(s.attributes), "resource": resource, "status": s.status.code,
                        "links": [(link.trace_id.hex(), link.span_id.hex()) for link in s.links],
                    })
        with self.lock:
            self.spans.extend(out)

    def trace(self, trace_id: str) -> list[dict]:
        with self.lock:
            return [s for s in self.spans if s["trace_id"] == trace_id]

    def wait_for(self, pred, timeout: float = 10.0) -> list[dict]:
        """Spans matching `pred`, waiting until at least one arrives (exports are batched)."""
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                found = [s for s in self.spans if pred(s)]
            if found or time.monotonic() > deadline:
                return found
            time.sleep(0.1)

    def close(self) -> None:
        self.server.shutdown()
        if self.grpc_server is not None:
            self.grpc_server.stop(0)
