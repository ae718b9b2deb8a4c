"""deploy/kubernetes validated without a cluster: every core object against the Kubernetes OpenAPI schemas
(kubernetes-validate, strict: unknown fields refused) for the oldest and newest version we claim, the CRD
objects against their published CRD schemas (vendored in deploy/kubernetes/schemas), and the manifests against
the code: the container args parse with `tokenfab serve`'s own parser (torchrun's parser for the
LeaderWorkerSet), probes hit a real route on the served port, grace periods cover the drain, and every name
one object gives another (selectors, the HPA's metric, the pool's endpoint picker) matches."""

from __future__ import annotations

import re
import shutil
import subprocess

import kubernetes_validate
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from torch.distributed.run import get_args_parser as torchrun_parser

from tests.deploy.manifests import CRD_SCHEMAS, DEPLOY, crd_validator, find, objects, render_module, values
from tests.server.fake_engine import FakeEngine, FakeStats
from tokenfab.cli import build_parser
from tokenfab.distributed import admission
from tokenfab.engine.core.async_engine import AsyncEngine
from tokenfab.server import wait_idle
from tokenfab.server.app import ServerConfig, build_app
from tokenfab.server.metrics import ServerMetrics

# 1.30: the first release with the preStop `sleep` action on by default (beta); 1.37: kubernetes-validate's newest
K8S_VERSIONS = ("1.30.0", "1.37.0")
LWS_ENV = {"LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1", "LWS_LEADER_ADDRESS": "tokenfab-mn-0.tokenfab-mn.ns"}


def core_objects() -> list[dict]:
    return [d for d in objects() if (d["apiVersion"], d["kind"]) not in CRD_SCHEMAS]


def serve_args(container: dict) -> object:
    """The container's `tokenfab serve` command line parsed by tokenfab's CLI parser."""
    argv = container["command"][1:] + container["args"]
    assert argv[0] == "serve"
    return build_parser(argv).parse_args(argv)


def lws_templates() -> dict[str, dict]:
    lws = find(objects(), "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]
    return {"leader": lws["leaderTemplate"], "worker": lws["workerTemplate"]}


def torchrun_args(container: dict, env: dict[str, str] = LWS_ENV):
    """torchrun's arguments after Kubernetes expands $(VAR) from the container's (LWS-injected) env."""
    assert container["command"] == ["torchrun"]
    expanded = [re.sub(r"\$\(([A-Z_]+)\)", lambda m: env[m.group(1)], a) for a in container["args"]]
    assert not any("$" in a for a in expanded)
    return torchrun_parser().parse_args(expanded)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_core_objects_validate_against_the_kubernetes_schemas(version):
    docs = core_objects()
    assert {d["kind"] for d in docs} >= {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget",
                                         "ConfigMap", "ServiceAccount", "Role", "RoleBinding"}
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_leaderworkerset_pod_templates_validate_as_core_pod_templates(version):
    for role, template in lws_templates().items():
        wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"lws-{role}"},
                   "template": template}
        kubernetes_validate.validate(wrapped, version, strict=True)


def test_kubernetes_validate_refuses_a_misspelt_field():
    deployment = find(objects(), "Deployment", values()["NAME"])
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[-1], strict=True)


def test_crd_objects_validate_against_their_published_schemas():
    crd_docs = [d for d in objects() if (d["apiVersion"], d["kind"]) in CRD_SCHEMAS]
    assert sorted(d["kind"] for d in crd_docs) == ["InferencePool", "LeaderWorkerSet"]
    for doc in crd_docs:
        crd_validator(doc["apiVersion"], doc["kind"]).validate(doc)


@pytest.mark.parametrize("kind,path,bad", [
    ("InferencePool", ("spec", "endpointPickerRef"), {"name": "x", "port": {"number": 9002}, "failMode": "FailOpen"}),
    ("InferencePool", ("spec", "targetPorts"), [{"number": 70000}]),
    ("LeaderWorkerSet", ("spec", "leaderWorkerTemplate", "restartPolicy"), "RecreateGroup"),
    ("LeaderWorkerSet", ("spec", "startupPolicy"), "LeaderStarted"),
    ("LeaderWorkerSet", ("spec", "leaderWorkerTemplate", "sizee"), 2),
])
def test_crd_schemas_refuse_a_wrong_field(kind, path, bad):
    doc = find(objects(), kind)
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = bad
    errors = list(crd_validator(doc["apiVersion"], kind).iter_errors(doc))
    assert errors, f"{kind} {'.'.join(path)} = {bad!r} passed the schema"


def test_deployment_args_are_real_serve_flags_and_probes_hit_a_real_route():
    v = values()
    pod = find(objects(), "Deployment", v["NAME"])["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = serve_args(container)
    assert args.model == v["MODEL_PATH"] and args.served_model_name == v["SERVED_MODEL_NAME"]
    assert args.host == "0.0.0.0"  # reachable from the kubelet and the Service, not only the pod's loopback
    gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
    assert args.tensor_parallel_size == int(v["GPUS_PER_POD"]) == gpus
    (port,) = container["ports"]
    assert port["containerPort"] == args.port
    app = build_app(AsyncEngine(FakeEngine()), ServerConfig())
    gets = {r.path for r in app.routes if "GET" in getattr(r, "methods", set())}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] in gets and get["path"] == "/health"
        assert get["port"] == port["name"]
    assert set(pod["volumes"][0]["persistentVolumeClaim"]) == {"claimName", "readOnly"}
    assert args.model.startswith(container["volumeMounts"][0]["mountPath"] + "/")


def test_deployment_grace_period_covers_the_drain():
    """SIGTERM after the preStop sleep: uvicorn stops accepting and waits up to --drain-timeout for the HTTP
    requests, then the engine drains for up to --drain-timeout again (server/app.py's lifespan) and the engine
    core gets 10 s to stop (core/client.py close): the pod must not be killed before that."""
    pod = find(objects(), "Deployment", values()["NAME"])["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    drain = serve_args(container).drain_timeout
    sleep = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert sleep >= 5 and drain > 0
    assert pod["terminationGracePeriodSeconds"] >= sleep + 2 * drain + 20


def test_leaderworkerset_launches_torchrun_with_the_lws_rendezvous():
    v = values()
    lws = find(objects(), "LeaderWorkerSet")
    assert lws["spec"]["startupPolicy"] == "LeaderCreated"  # LeaderReady would wait for a world that cannot form
    assert lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    size = lws["spec"]["leaderWorkerTemplate"]["size"]
    for role, template in lws_templates().items():
        (container,) = template["spec"]["containers"]
        for var in ("LWS_GROUP_SIZE", "LWS_WORKER_INDEX", "LWS_LEADER_ADDRESS"):
            assert any(f"$({var})" in a for a in container["args"]), f"{role}: no $({var})"
        run = torchrun_args(container)
        assert int(run.nnodes) == size == int(LWS_ENV["LWS_GROUP_SIZE"])
        assert int(run.nproc_per_node) == int(container["resources"]["limits"]["nvidia.com/gpu"])
        assert run.node_rank == 1 and run.master_addr == LWS_ENV["LWS_LEADER_ADDRESS"]
        assert run.master_port == int(v["TORCHRUN_PORT"])
        assert run.module and run.training_script == "tokenfab"
        serve = build_parser(run.training_script_args).parse_args(run.training_script_args)
        assert serve.command == "serve" and serve.model == v["LWS_MODEL_PATH"]
        assert serve.enable_expert_parallel and serve.host == "0.0.0.0"
        world = size * int(run.nproc_per_node)
        assert serve.tensor_parallel_size in (1, world)  # 1: tokenfab serve takes torchrun's world size
        admission.check_launch(serve.tensor_parallel_size, serve.data_parallel_size, torchrun=True)
        if role == "leader":
            (http,) = [p for p in container["ports"] if p["name"] == "http"]
            assert http["containerPort"] == serve.port
            assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    leader = lws_templates()["leader"]["spec"]["containers"][0]
    worker = lws_templates()["worker"]["spec"]["containers"][0]
    assert leader["args"] == worker["args"]  # one command line; LWS_WORKER_INDEX alone tells the nodes apart
    assert "readinessProbe" not in worker and "ports" not in worker  # only global rank 0 serves HTTP


def test_leaderworkerset_stop_order_keeps_workers_up_while_the_leader_drains():
    """torchrun hands SIGTERM to every local rank at once, so the leader drains in its preStop hook
    (tokenfab.server.wait_idle) and the workers' preStop sleep outlasts that hook."""
    leader, worker = (t["spec"] for t in lws_templates().values())
    hook = leader["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert hook[:3] == ["python", "-m", "tokenfab.server.wait_idle"]
    waits = wait_idle.build_parser().parse_args(hook[3:])
    script_args = torchrun_args(leader["containers"][0]).training_script_args
    serve = build_parser(script_args).parse_args(script_args)
    assert waits.port == serve.port and waits.timeout == serve.drain_timeout and waits.sleep >= 5
    worker_sleep = worker["containers"][0]["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert worker_sleep >= waits.sleep + waits.timeout + 10
    for spec in (leader, worker):
        assert spec["terminationGracePeriodSeconds"] >= worker_sleep + 30  # torchrun waits 30 s for its ranks


def test_services_and_the_pool_select_the_right_pods():
    docs = objects()
    v = values()
    replica = find(docs, "Deployment", v["NAME"])
    replica_labels = replica["spec"]["template"]["metadata"]["labels"]
    assert replica["spec"]["selector"]["matchLabels"].items() <= replica_labels.items()
    service = find(docs, "Service", v["NAME"])
    assert service["spec"]["selector"].items() <= replica_labels.items()
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    pdb = find(docs, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= replica_labels.items()
    templates = lws_templates()
    leader_labels = templates["leader"]["metadata"]["labels"]
    worker_labels = templates["worker"]["metadata"]["labels"]
    lws_name = find(docs, "LeaderWorkerSet")["metadata"]["name"]
    # the replica selectors must not take the group's pods
    assert not replica["spec"]["selector"]["matchLabels"].items() <= leader_labels.items()
    # LWS adds its own labels to every pod: the leader Service selects index 0 of this set
    mn = find(docs, "Service", lws_name)
    assert mn["spec"]["selector"] == {"leaderworkerset.sigs.k8s.io/name": lws_name,
                                      "leaderworkerset.sigs.k8s.io/worker-index": "0"}
    pool = find(docs, "InferencePool")
    selector = pool["spec"]["selector"]["matchLabels"]
    assert selector.items() <= replica_labels.items() and selector.items() <= leader_labels.items()
    assert not selector.items() <= worker_labels.items()  # workers serve no HTTP
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [int(v["PORT"])]
    ref = pool["spec"]["endpointPickerRef"]
    epp_service = find(docs, "Service", ref["name"])
    assert ref["port"]["number"] in [p["port"] for p in epp_service["spec"]["ports"]]
    epp = find(docs, "Deployment", ref["name"])
    epp_pod = epp["spec"]["template"]
    assert epp_service["spec"]["selector"].items() <= epp_pod["metadata"]["labels"].items()
    args = epp_pod["spec"]["containers"][0]["args"]
    flags = dict(zip(args[::2], args[1::2]))
    assert flags["--pool-name"] == pool["metadata"]["name"] and flags["--pool-namespace"] == v["NAMESPACE"]
    assert flags["--pool-group"] == pool["apiVersion"].split("/")[0]
    config = find(docs, "ConfigMap", epp_pod["spec"]["volumes"][0]["configMap"]["name"])
    assert flags["--config-file"].removeprefix("/config/") in config["data"]
    assert epp_pod["spec"]["serviceAccountName"] == find(docs, "RoleBinding")["subjects"][0]["name"]


def test_hpa_scales_the_deployment_on_the_waiting_series_served_by_the_adapter_rule():
    docs = objects()
    hpa = find(docs, "HorizontalPodAutoscaler")
    target = hpa["spec"]["scaleTargetRef"]
    deployment = find(docs, "Deployment", values()["NAME"])
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["target"]["type"] == "AverageValue"
    adapter = yaml.safe_load(render_module.substitute((DEPLOY / "prometheus-adapter-values.yaml").read_text(), {}))
    (rule,) = adapter["rules"]["custom"]
    series = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)\{", rule["seriesQuery"]).group(1)
    assert series == "vllm:num_requests_waiting"
    exposed = re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1"), series)
    assert exposed == metric["pods"]["metric"]["name"]
    assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}  # per-pod values, as a Pods metric needs
    assert hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]


def test_render_refuses_a_missing_value_and_an_unknown_override():
    with pytest.raises(KeyError, match="NOT_A_VALUE"):
        render_module.substitute("image: ${NOT_A_VALUE}", values())
    with pytest.raises(KeyError, match="IMAGES"):
        render_module.render(overrides={"IMAGES": "x"})
    deployment = find(objects(("deployment.yaml",), IMAGE="my/tokenfab:1", REPLICAS="5"), "Deployment")
    assert deployment["spec"]["replicas"] == 5
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == "my/tokenfab:1"
    text = render_module.render()
    assert "$(LWS_LEADER_ADDRESS)" in text and "${" not in text


@pytest.mark.skipif(shutil.which("envsubst") is None, reason="envsubst (gettext) not installed")
def test_envsubst_renders_what_render_py_renders():
    env = {"PATH": "/usr/bin:/bin", **values()}
    for name in render_module.MANIFESTS:
        text = (DEPLOY / name).read_text()
        out = subprocess.run(["envsubst"], input=text, env=env, capture_output=True, text=True, check=True).stdout
        assert out == render_module.substitute(text, values(), name)


def test_the_series_the_hpa_and_the_endpoint_picker_read_are_served():
    """The adapter rule's series and the three that llm-d's endpoint picker (v0.10.0's core metrics extractor)
    reads for queue and KV-cache scoring, as tokenfab's /metrics renders them."""
    stats = FakeStats(num_running=2, kv_cache_usage=0.25)
    text = ServerMetrics("m", stats=lambda: stats, waiting=lambda: 3).render().decode()
    served = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    adapter = yaml.safe_load((DEPLOY / "prometheus-adapter-values.yaml").read_text())
    series = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)\{", adapter["rules"]["custom"][0]["seriesQuery"]).group(1)
    assert served[series] == 3
    assert served["vllm:num_requests_running"] == 2 and served["vllm:kv_cache_usage_perc"] == 0.25
