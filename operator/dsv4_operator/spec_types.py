"""The `Dsv4Deployment` resource as a pydantic model: one model for the operator, its admission webhook
and the local launcher.

Field names are camelCase in YAML (aliases) and snake_case in Python. Every default here equals the
default in `crds/dsv4deployment.yaml` (a test applies the CRD's defaults to every example and compares).
Types are strict, as the API server's are: `"8"` is not an integer. Cross-field rules live in
`spec_rules.py`; `spec.parse` runs both and reports every problem as a (field path, reason) pair.

The model has a module of its own, below both, because the rules need it and `parse` needs the rules
(with the model in spec.py, spec.py and spec_rules.py imported each other). spec.py re-exports it.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PlainValidator
from pydantic.alias_generators import to_camel

API_VERSION = "dsv4.ai/v1alpha1"
KIND = "Dsv4Deployment"

# Kubernetes' own quantity grammar (apimachinery resource.Quantity).
QUANTITY_RE = re.compile(
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
# The resource name becomes part of child names (`<name>-prefill-<fingerprint>`); StatefulSet names
# longer than 52 characters break the controller-revision-hash label, so 33 is the most that fits.
NAME_RE = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
NAME_MAX = 33
RESOURCE_NAME_RE = r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
REL_PATH_RE = r"^([A-Za-z0-9._@+=-]+(/[A-Za-z0-9._@+=-]+)*)?$"
ABS_PATH_RE = r"^/([A-Za-z0-9._@+=-]+(/[A-Za-z0-9._@+=-]+)*)?$"
ENV_NAME_RE = r"^[A-Za-z_][A-Za-z0-9_]*$"
SECRET_KEY_RE = r"^[-._a-zA-Z0-9]+$"
MODEL_NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$"
IFNAME_RE = r"^[\^=]{0,2}[A-Za-z0-9_.:-]+(,[A-Za-z0-9_.:-]+)*$"
IMAGE_RE = r"^[^\s]+$"
LABEL_VALUE_RE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
LABEL_KEY_RE = r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
DURATION_RE = r"^(0|([0-9]+(ms|s|m|h))+)$"  # Prometheus' duration (a scrape interval)
BYTE_SIZE_RE = r"^[1-9][0-9]*(Ki|Mi|Gi|Ti)?$"  # what `dsv4 serve` takes as a byte count (IEC only)

# Largest number of NPUs one node holds (Atlas 800 A3: 16 dies). A server that needs more spans nodes.
MAX_NPUS_PER_NODE = 16


def _quantity(value: Any) -> int | str:
    # int-or-string, as Kubernetes' `x-kubernetes-int-or-string` quantities (bool is not an int here).
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError("must be a Kubernetes quantity (an integer or a string such as '64Gi')")
    if isinstance(value, str) and not QUANTITY_RE.match(value):
        raise ValueError(f"{value!r} is not a Kubernetes quantity (e.g. '500m', '64Gi', '8')")
    return value


def _no_dotdot(value: str) -> str:
    if ".." in value.split("/"):
        raise ValueError("must not contain a '..' segment")
    return value


Quantity = Annotated[Any, PlainValidator(_quantity)]
Name = Annotated[str, Field(pattern=DNS_SUBDOMAIN, min_length=1, max_length=253)]
RelPath = Annotated[str, Field(pattern=REL_PATH_RE, max_length=1024), AfterValidator(_no_dotdot)]
AbsPath = Annotated[str, Field(pattern=ABS_PATH_RE, max_length=1024), AfterValidator(_no_dotdot)]
Port = Annotated[int, Field(ge=1024, le=65535)]
StrMap = dict[str, Annotated[str, Field(max_length=1024)]]


class _Model(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, validate_by_name=False, validate_by_alias=True, extra="forbid", strict=True
    )


class PvcSource(_Model):
    claim_name: Name
    path: RelPath | None = None  # inside the volume; unset or "" = its root


class PrefixCacheVolume(PvcSource):
    """Where prefill servers keep their prefix cache (`dsv4 serve --prefix-cache-dir`): maxSize is
    their --prefix-cache-max-bytes, saveIntervalSeconds their --prefix-cache-save-interval."""

    max_size: Annotated[str, Field(pattern=BYTE_SIZE_RE, max_length=32)] | None = None
    save_interval_seconds: Annotated[int, Field(ge=0, le=86400)] | None = None


class HostPathSource(_Model):
    path: AbsPath


class ImageSource(_Model):
    path: AbsPath  # where the weights sit inside the engine image


class ModelSpec(_Model):
    served_model_name: Annotated[str, Field(pattern=MODEL_NAME_RE, max_length=128)] = "deepseek-v4"
    revision: Annotated[str, Field(pattern=LABEL_VALUE_RE, max_length=63)] | None = None
    pvc: PvcSource | None = None
    host_path: HostPathSource | None = None
    image: ImageSource | None = None


class EnvVar(_Model):
    name: Annotated[str, Field(pattern=ENV_NAME_RE, max_length=128)]
    value: Annotated[str, Field(max_length=4096)] | None = None


class EngineSpec(_Model):
    device: Literal["npu", "cuda", "cpu"] = "npu"
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    page_size: Annotated[int, Field(ge=128, le=4096, multiple_of=128)] = 128
    max_model_len: Annotated[int, Field(ge=128, le=1048576)] = 131072
    chunked_prefill_size: Annotated[int, Field(ge=128, le=1048576)] = 8192
    max_num_seqs: Annotated[int, Field(ge=1, le=4096)] = 256
    max_waiting: Annotated[int, Field(ge=0, le=1000000)] = 1024
    transfer_protocol: Literal["tcp", "rdma", "ascend"] = "ascend"
    port: Port = 30000
    bootstrap_port: Port = 8998
    grace_period_seconds: Annotated[int, Field(ge=0, le=3600)] = 60
    enforce_eager: bool = True
    prefix_cache: bool = True
    prefix_cache_volume: PrefixCacheVolume | None = None
    speculative_num_steps: Annotated[int, Field(ge=0, le=8)] = 0
    env: Annotated[list[EnvVar], Field(max_length=64)] | None = None


class Toleration(_Model):
    key: Annotated[str, Field(max_length=316)] | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: Annotated[str, Field(max_length=63)] | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class Resources(_Model):
    requests: Annotated[dict[str, Quantity], Field(max_length=32)] | None = None
    limits: Annotated[dict[str, Quantity], Field(max_length=32)] | None = None


class _Placement(_Model):
    resources: Resources | None = None
    node_selector: Annotated[StrMap, Field(max_length=64)] | None = None
    tolerations: Annotated[list[Toleration], Field(max_length=64)] | None = None


class RoleSpec(_Placement):
    replicas: Annotated[int, Field(ge=0, le=1024)] = 1
    npus_per_pod: Annotated[int, Field(ge=0)] = 8  # upper bound (16) is a rule with a multi-node message
    npu_resource_name: Annotated[str, Field(pattern=RESOURCE_NAME_RE, max_length=253)] = (
        "huawei.com/Ascend910"
    )
    tensor_parallel_size: Annotated[int, Field(ge=1, le=64)] = 8
    expert_parallel_size: Annotated[int, Field(ge=1, le=64)] = 1
    shared_memory_size: Quantity = "16Gi"
    affinity: dict[str, Any] | None = None  # core/v1 Affinity, checked by the API server on the pods
    priority_class_name: Name | None = None


PrefillPolicy = Literal["random", "round_robin", "cache_aware", "power_of_two", "bucket", "manual"]
DecodePolicy = Literal["random", "round_robin", "cache_aware", "power_of_two"]


class RouterSpec(_Placement):
    replicas: Annotated[int, Field(ge=1, le=64)] = 1
    image: Annotated[str, Field(pattern=IMAGE_RE, max_length=512)] | None = None  # default: spec.image
    prefill_policy: PrefillPolicy = "cache_aware"
    decode_policy: DecodePolicy = "power_of_two"
    port: Port = 8000
    metrics_port: Port = 29000
    request_timeout_seconds: Annotated[int, Field(ge=1, le=86400)] = 1800


class ServiceSpec(_Model):
    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    port: Annotated[int, Field(ge=1, le=65535)] = 8000
    node_port: Annotated[int, Field(ge=30000, le=32767)] | None = None
    annotations: Annotated[StrMap, Field(max_length=64)] | None = None


class SecretKeyRef(_Model):
    name: Name
    key: Annotated[str, Field(pattern=SECRET_KEY_RE, max_length=253)] = "api-key"


class AscendSpec(_Model):
    mount_hccn_conf: bool = True
    hccn_conf_path: AbsPath = "/etc/hccn.conf"
    # The driver and its tools (dcmi, npu-smi, ascend_install.info), unless a runtime injects them.
    mount_driver: bool = True
    driver_path: AbsPath = "/usr/local/Ascend/driver"
    hccl_socket_ifname: Annotated[str, Field(pattern=IFNAME_RE, max_length=256)] = "eth0"
    # The node's network namespace for the servers: HCCL and Mooncake then use the node's NICs.
    host_network: bool = False
    # HwHiAiUser's gid on the nodes (MindCluster creates it as 1000): the pods join it to use the driver.
    driver_group_id: Annotated[int, Field(ge=0, le=2147483647)] = 1000


class RolloutSpec(_Model):
    progress_deadline_seconds: Annotated[int, Field(ge=60, le=86400)] = 3600
    drain_seconds: Annotated[int, Field(ge=0, le=86400)] = 120


class ProbesSpec(_Model):
    startup_timeout_seconds: Annotated[int, Field(ge=60, le=86400)] = 3600


class PodSecuritySpec(_Model):
    run_as_user: Annotated[int, Field(ge=1, le=2147483647)] = 1000
    run_as_group: Annotated[int, Field(ge=0, le=2147483647)] = 1000
    fs_group: Annotated[int, Field(ge=0, le=2147483647)] = 1000


class NetworkPolicySpec(_Model):
    enabled: bool = True


LabelKey = Annotated[str, Field(pattern=LABEL_KEY_RE, max_length=316)]
LabelValue = Annotated[str, Field(pattern=LABEL_VALUE_RE, max_length=63)]


class LabelSelectorRequirement(_Model):
    key: LabelKey
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: Annotated[list[LabelValue], Field(max_length=64)] | None = None


class LabelSelector(_Model):
    """A meta/v1 LabelSelector (an empty one selects everything)."""

    match_labels: Annotated[dict[str, LabelValue], Field(max_length=64)] | None = None
    match_expressions: Annotated[list[LabelSelectorRequirement], Field(max_length=64)] | None = None


class ScraperSpec(_Model):
    """Who may scrape: a networking/v1 NetworkPolicyPeer (pods of the selected namespaces, or pods of
    this namespace, or the selected pods of the selected namespaces)."""

    namespace_selector: LabelSelector | None = None
    pod_selector: LabelSelector | None = None


class PodMonitorSpec(_Model):
    enabled: bool = False
    labels: Annotated[dict[str, LabelValue], Field(max_length=64)] | None = None
    interval: Annotated[str, Field(pattern=DURATION_RE, max_length=32)] | None = None


class MonitoringSpec(_Model):
    metrics_port: Port = 29100
    scraper: ScraperSpec | None = None
    pod_monitor: PodMonitorSpec = Field(default_factory=PodMonitorSpec)


class LocalObjectReference(_Model):
    name: Name


class Dsv4DeploymentSpec(_Model):
    image: Annotated[str, Field(pattern=IMAGE_RE, min_length=1, max_length=512)]
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    image_pull_secrets: Annotated[list[LocalObjectReference], Field(max_length=16)] | None = None
    model: ModelSpec
    engine: EngineSpec = Field(default_factory=EngineSpec)
    prefill: RoleSpec = Field(default_factory=RoleSpec)
    decode: RoleSpec = Field(default_factory=RoleSpec)
    router: RouterSpec = Field(default_factory=RouterSpec)
    service: ServiceSpec = Field(default_factory=ServiceSpec)
    api_key_secret: SecretKeyRef | None = None
    ascend: AscendSpec = Field(default_factory=AscendSpec)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    probes: ProbesSpec = Field(default_factory=ProbesSpec)
    pod_security: PodSecuritySpec = Field(default_factory=PodSecuritySpec)
    network_policy: NetworkPolicySpec = Field(default_factory=NetworkPolicySpec)
    monitoring: MonitoringSpec = Field(default_factory=MonitoringSpec)
    pod_annotations: Annotated[StrMap, Field(max_length=64)] | None = None


class Metadata(BaseModel):
    # Only what the spec needs; the rest of ObjectMeta (uid, resourceVersion, ...) passes through.
    model_config = ConfigDict(extra="allow", strict=True)
    name: Annotated[str, Field(pattern=NAME_RE, min_length=1, max_length=NAME_MAX)]
    namespace: Annotated[str, Field(pattern=DNS_LABEL, max_length=63)] | None = None


class Dsv4Deployment(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, validate_by_alias=True, extra="ignore", strict=True)
    api_version: Literal["dsv4.ai/v1alpha1"] = API_VERSION
    kind: Literal["Dsv4Deployment"] = KIND
    metadata: Metadata
    spec: Dsv4DeploymentSpec

    @property
    def name(self) -> str:
        return self.metadata.name

    def spec_dict(self) -> dict[str, Any]:
        """The spec as the API server stores it after defaulting (camelCase, no nulls)."""
        return self.spec.model_dump(by_alias=True, exclude_none=True, mode="json")
