"""deploy/k8s/qwen-trt.yaml, offline: the Deployment and Service against Kubernetes' own schemas
(kubernetes-validate, strict: no unknown fields), the InferencePool against the fields of the
Inference Extension's v1 CRD (kubernetes-sigs/gateway-api-inference-extension,
config/crd/bases/inference.networking.k8s.io_inferencepools.yaml @84436a9, which
kubernetes-validate does not carry: a schema of those fields below), and the pieces against each
other and against ``qwen-trt serve`` itself (the container's arguments parse and check)."""
from __future__ import annotations

import argparse
import re

import pytest

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate")
jsonschema = pytest.importorskip("jsonschema")

from servers import ROOT  # noqa: E402

MANIFEST = ROOT / "deploy" / "k8s" / "qwen-trt.yaml"
K8S_VERSION = "1.33.0"
LABEL_VALUE = {"type": "string", "maxLength": 63,
               "pattern": r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"}
PORT = {"type": "object", "required": ["number"], "additionalProperties": False,
        "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 65535}}}
INFERENCE_POOL = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "inference.networking.k8s.io/v1"},
        "kind": {"const": "InferencePool"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object", "additionalProperties": False,
            "required": ["selector", "targetPorts", "endpointPickerRef"],
            "properties": {
                "appProtocol": {"enum": ["http", "kubernetes.io/h2c"]},
                "selector": {
                    "type": "object", "required": ["matchLabels"], "additionalProperties": False,
                    "properties": {"matchLabels": {
                        "type": "object", "minProperties": 1, "maxProperties": 64,
                        "additionalProperties": LABEL_VALUE}}},
                "targetPorts": {"type": "array", "minItems": 1, "maxItems": 8, "items": PORT},
                "endpointPickerRef": {
                    "type": "object", "required": ["name", "port"], "additionalProperties": False,
                    "properties": {
                        "group": {"type": "string", "maxLength": 253},
                        "kind": {"type": "string", "pattern": r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$"},
                        "name": {"type": "string", "minLength": 1, "maxLength": 253},
                        "port": PORT,
                        "failureMode": {"enum": ["FailOpen", "FailClose"]}}}}}}}


@pytest.fixture(scope="module")
def objects() -> dict[str, dict]:
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    by_kind = {d["kind"]: d for d in docs}
    assert len(by_kind) == len(docs) and set(by_kind) == {"Deployment", "Service", "InferencePool"}
    return by_kind


def test_core_objects_pass_kubernetes_schemas(objects):
    for kind in ("Deployment", "Service"):
        kubernetes_validate.validate(objects[kind], K8S_VERSION, strict=True)
    bad = {**objects["Service"], "spec": {**objects["Service"]["spec"], "portz": []}}
    with pytest.raises(kubernetes_validate.ValidationError):     # the check can fail
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_the_inference_pool_has_the_crds_fields(objects):
    pool = objects["InferencePool"]
    jsonschema.validate(pool, INFERENCE_POOL)
    wrong = {**pool, "spec": {**pool["spec"], "targetPortNumber": 8000}}     # the v1alpha2 name
    assert not jsonschema.Draft202012Validator(INFERENCE_POOL).is_valid(wrong)


def container(objects) -> dict:
    (c,) = objects["Deployment"]["spec"]["template"]["spec"]["containers"]
    return c


def test_the_pieces_fit_together(objects):
    dep, svc, pool = objects["Deployment"], objects["Service"], objects["InferencePool"]
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert svc["spec"]["selector"].items() <= labels.items()
    c = container(objects)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == list(ports.values())
    assert svc["spec"]["ports"][0]["targetPort"] in ports
    for probe in ("startupProbe", "readinessProbe"):
        get = c[probe]["httpGet"]
        assert get["path"] == "/health" and get["port"] in ports
    assert "livenessProbe" not in c          # /health's 503 during an engine restart is no death
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    container_env = {e["name"]: e for e in c["env"]}
    assert container_env["QWEN_TRT_API_KEY"]["valueFrom"]["secretKeyRef"]["name"]
    args = c["args"]
    assert int(args[args.index("--port") + 1]) == ports["http"]
    # the topic names the pod by the variable the downward API fills in
    for var in re.findall(r"\$\((\w+)\)", " ".join(args)):
        assert container_env[var]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"


def test_the_container_command_is_a_valid_qwen_trt_serve(objects):
    from qwen_trt.commands import serve

    c = container(objects)
    assert c["command"] == ["qwen-trt", "serve"]
    args = [a.replace("$(POD_IP)", "10.0.0.7") for a in c["args"]]
    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    parsed = parser.parse_args(["serve", *args])
    s = serve.settings_from(parsed, {"QWEN_TRT_API_KEY": "k" * 32})   # from the Secret
    assert s.host == "0.0.0.0" and s.port == 8000 and s.model_name == "qwen3-4b"
    assert s.kv_events == "tcp://qwen-trt-epp:5557" and s.kv_events_topic == "kv@10.0.0.7@qwen3-4b"
    grace = objects["Deployment"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > s.shutdown_grace_s
