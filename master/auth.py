"""Who may call the master, and what: principals from tokens, tenants bound to namespaces.

Without a cluster secret the master authenticates nobody (allowed only on loopback
or with `allow_insecure`, see kvtier.master.config). With one, every gRPC call must
carry a token (kvtier.proto.auth) in its `authorization` metadata, and every
fast-path connection must open with an AUTH frame: no token or a wrong one is
UNAUTHENTICATED before any handler runs.

The `cluster` principal (the cluster secret: segment servers, operators, trusted
engines) may call everything. A tenant (`tenants_file`) may call only the data
RPCs, and only for namespaces matching its patterns (`fnmatch`, e.g. "alice-*"):
anything else is PERMISSION_DENIED. Segment-server RPCs, drains, migrations,
cluster status and quota registration stay with the cluster principal.

    # tenants.toml
    [tenants.alice]
    secret_file = "/etc/kvtier/tenants/alice.secret"   # mode 0600
    namespaces = ["alice-*"]
"""

from __future__ import annotations

import contextvars
import fnmatch
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from kvtier.common.config import read_toml
from kvtier.common.logs import LogBudget
from kvtier.proto.auth import AUTH_METADATA, CLUSTER_PRINCIPAL, principal_problem, read_secret, verify_token

logger = logging.getLogger(__name__)

# The principal of the call being handled: set by the interceptor (gRPC) or the fast-path
# connection, read by the handlers' wrapper. CLUSTER_PRINCIPAL when authentication is off.
current_principal: contextvars.ContextVar[str] = contextvars.ContextVar("kvtier_principal", default=CLUSTER_PRINCIPAL)

# What a tenant may call; each of these names its namespace(s) in the request.
TENANT_RPCS = frozenset(
    ("Hello", "PutStart", "PutEnd", "PutRevoke", "GetReplicas", "Exists", "Remove", "RemovePrefix", "ReportCorrupt")
    + ("ListKeys", "StatKeys", "WatchEvents")
)


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    namespaces: tuple[str, ...]  # fnmatch patterns
    # Engine instances whose quota accounts its puts may be charged to (fnmatch patterns); empty: the
    # namespace patterns. Without it a tenant naming another's registered instance was charged to
    # that quota and evicted the other's objects to make room.
    instances: tuple[str, ...] = ()

    def allows(self, namespace: str) -> bool:
        return any(fnmatch.fnmatchcase(namespace, pattern) for pattern in self.namespaces)

    def allows_instance(self, instance: str) -> bool:
        return any(fnmatch.fnmatchcase(instance, pattern) for pattern in self.instances or self.namespaces)


class Authenticator:
    """Tokens to principals, and principals' rights. `enabled` is False without a cluster secret."""

    def __init__(self, cluster_secret: bytes | None, tenants: dict[str, tuple[bytes, Tenant]] | None = None) -> None:
        self.enabled = cluster_secret is not None
        self.cluster_secret = cluster_secret
        self._secrets: dict[str, bytes] = {}
        self.tenants: dict[str, Tenant] = {}
        if cluster_secret is not None:
            self._secrets[CLUSTER_PRINCIPAL] = cluster_secret
        for name, (secret, tenant) in (tenants or {}).items():
            self._secrets[name] = secret
            self.tenants[name] = tenant
        self._known: dict[str, str] = {}  # verified token -> principal (one entry per principal)

    def principal(self, token: str) -> str:
        """The principal `token` proves; "" when it proves none. Always the cluster when disabled."""
        if not self.enabled:
            return CLUSTER_PRINCIPAL
        if (known := self._known.get(token)) is not None:
            return known
        principal = verify_token(token, self._secrets)
        if principal:
            self._known[token] = principal
        return principal

    def refusal(self, principal: str, rpc: str, request: Any) -> str:
        """Why `principal` may not make this call ("" = it may)."""
        if principal == CLUSTER_PRINCIPAL:
            return ""
        tenant = self.tenants.get(principal)
        if tenant is None or rpc not in TENANT_RPCS:
            return f"{principal!r} may not call {rpc} (cluster credentials only)"
        namespace = getattr(request, "namespace", None)
        if namespace is not None and not tenant.allows(namespace):
            return f"tenant {principal!r} may not use namespace {namespace!r}"
        instance = getattr(request, "instance", "") if rpc == "PutStart" else ""
        if instance and not tenant.allows_instance(instance):
            return (
                f"tenant {principal!r} may not be charged to instance {instance!r:.80} "
                "(its instances patterns in the tenants file, by default its namespace patterns)"
            )
        return ""


def load_tenants(path: str) -> dict[str, tuple[bytes, Tenant]]:
    """The tenants file (see the module docstring); ValueError with one line naming the problem."""
    document = read_toml(path, "tenants file")
    unknown = set(document) - {"tenants"}
    if unknown:
        raise ValueError(f"tenants file {path}: unknown key {sorted(unknown)[0]!r} (expected [tenants.NAME] tables)")
    out: dict[str, tuple[bytes, Tenant]] = {}
    for name, entry in document.get("tenants", {}).items():
        where = f"tenants file {path}: tenant {name!r}"
        if name == CLUSTER_PRINCIPAL:
            raise ValueError(f"{where}: the name is reserved for the cluster secret")
        if problem := principal_problem(name):
            raise ValueError(f"{where}: {problem}")
        if not isinstance(entry, dict) or set(entry) - {"secret_file", "namespaces", "instances"}:
            raise ValueError(f"{where}: takes exactly secret_file, namespaces and (optional) instances")
        patterns = entry.get("namespaces")
        if not isinstance(patterns, list) or not patterns or not all(isinstance(p, str) and p for p in patterns):
            raise ValueError(f"{where}: namespaces must be a non-empty list of patterns")
        instances = entry.get("instances", [])
        if not isinstance(instances, list) or not all(isinstance(p, str) and p for p in instances):
            raise ValueError(f"{where}: instances must be a list of patterns")
        secret_file = entry.get("secret_file")
        if not isinstance(secret_file, str) or not secret_file:
            raise ValueError(f"{where}: secret_file is required")
        secret = read_secret(secret_file, env="")
        assert secret is not None
        out[name] = (secret, Tenant(name, tuple(patterns), tuple(instances)))
    return out


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Checks every gRPC call's token before its handler; sets `current_principal` for it."""

    def __init__(self, authenticator: Authenticator) -> None:
        self._auth = authenticator
        self.refused = 0
        self._log = LogBudget(logger, "unauthenticated call")

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        token = ""
        for key, value in details.invocation_metadata or ():
            if key == AUTH_METADATA:
                token = value if isinstance(value, str) else value.decode(errors="replace")
                break
        principal = self._auth.principal(token)
        if not principal:
            self.refused += 1
            self._log.log(
                logging.WARNING,
                "unauthenticated call refused",
                extra={"fields": {"method": details.method, "credentials": "missing" if not token else "wrong"}},
            )
            return _deny(
                "missing credentials: this cluster needs its secret (secret_file or KVTIER_SECRET)"
                if not token
                else "wrong credentials: the token does not match this cluster's secret or a tenant's"
            )
        if principal != CLUSTER_PRINCIPAL and details.method.rpartition("/")[2] not in TENANT_RPCS:
            # Refused before any servicer code runs (a long poll must not hold a slot, or a
            # segment's wake-up event, for a caller who may not make it); the handler checks again.
            return _deny(f"{principal!r} may not call {details.method} (cluster credentials only)", denied=True)
        current_principal.set(principal)  # same task as the handler: it sees this
        return await continuation(details)


def _deny(message: str, denied: bool = False) -> grpc.RpcMethodHandler:
    code = grpc.StatusCode.PERMISSION_DENIED if denied else grpc.StatusCode.UNAUTHENTICATED

    async def abort(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, message)

    return grpc.unary_unary_rpc_method_handler(abort)
