"""A real OTLP receiver for tests: decodes ExportTraceServiceRequest protobufs (spans) and, on
`/v1/metrics` (or the gRPC MetricsService), ExportMetricsServiceRequest protobufs (metric points)."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
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
        self.points: list[dict] = []  # every metric data point received, in arrival order
        self.trace_requests: list[ExportTraceServiceRequest] = []  # as received over HTTP, in arrival order
        self.lock = threading.Lock()
        self.grpc_server = self._start_grpc() if grpc else None
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.path.rstrip("/").endswith("/v1/metrics"):
                    req, out = ExportMetricsServiceRequest(), ExportMetricsServiceResponse().SerializeToString()
                    req.ParseFromString(body)
                    receiver._add_metrics(req)
                else:
                    req, out = ExportTraceServiceRequest(), ExportTraceServiceResponse().SerializeToString()
                    req.ParseFromString(body)
                    receiver._add(req)
                    with receiver.lock:
                        receiver.trace_requests.append(req)
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
        from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

        receiver = self

        class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):  # noqa: N802
                receiver._add(request)
                return ExportTraceServiceResponse()

        class MetricsServicer(metrics_service_pb2_grpc.MetricsServiceServicer):
            def Export(self, request, context):  # noqa: N802
                receiver._add_metrics(request)
                return ExportMetricsServiceResponse()

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(MetricsServicer(), server)
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
                    out.append(
                        {
                            "trace_id": s.trace_id.hex(),
                            "span_id": s.span_id.hex(),
                            "parent_span_id": s.parent_span_id.hex() or None,
                            "name": s.name,
                            "kind": KINDS[s.kind],
                            "start_ns": s.start_time_unix_nano,
                            "end_ns": s.end_time_unix_nano,
                            "attributes": _attrs(s.attributes),
                            "resource": resource,
                            "status": s.status.code,
                            "links": [(link.trace_id.hex(), link.span_id.hex()) for link in s.links],
                            "scope": ss.scope.name,
                            "schema_url": ss.schema_url,
                        }
                    )
        with self.lock:
            self.spans.extend(out)

    def _add_metrics(self, req: ExportMetricsServiceRequest) -> None:
        out = []
        for rm in req.resource_metrics:
            resource = _attrs(rm.resource.attributes)
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    kind = m.WhichOneof("data")
                    data = getattr(m, kind)
                    for dp in data.data_points:
                        point = {
                            "name": m.name,
                            "unit": m.unit,
                            "description": m.description,
                            "kind": kind,
                            "scope": sm.scope.name,
                            "schema_url": sm.schema_url,
                            "resource": resource,
                            "attributes": _attrs(dp.attributes),
                            "start_ns": dp.start_time_unix_nano,
                            "time_ns": dp.time_unix_nano,
                            "temporality": getattr(data, "aggregation_temporality", None),
                        }
                        if kind == "histogram":
                            point.update(
                                count=dp.count,
                                sum=dp.sum,
                                bounds=list(dp.explicit_bounds),
                                bucket_counts=list(dp.bucket_counts),
                            )
                        elif kind == "exponential_histogram":
                            point.update(
                                count=dp.count,
                                sum=dp.sum,
                                scale=dp.scale,
                                zero_count=dp.zero_count,
                                positive_offset=dp.positive.offset,
                                positive_counts=list(dp.positive.bucket_counts),
                            )
                        elif kind in ("sum", "gauge"):
                            point["value"] = getattr(dp, dp.WhichOneof("value"))
                            point["monotonic"] = getattr(data, "is_monotonic", None)
                        out.append(point)
        with self.lock:
            self.points.extend(out)

    def latest_points(self, name: str) -> list[dict]:
        """The newest point of each series (resource + attributes) of metric `name`: with cumulative
        temporality (the SDKs' default) each holds the series' totals."""
        latest: dict = {}
        with self.lock:
            for p in self.points:
                if p["name"] != name:
                    continue
                key = (
                    tuple(sorted((k, str(v)) for k, v in p["resource"].items())),
                    tuple(sorted((k, str(v)) for k, v in p["attributes"].items())),
                )
                if key not in latest or p["time_ns"] >= latest[key]["time_ns"]:
                    latest[key] = p
        return list(latest.values())

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
            time.sleep(0.1)  # clock: the poll interval

    def close(self) -> None:
        self.server.shutdown()
        if self.grpc_server is not None:
            self.grpc_server.stop(0)
