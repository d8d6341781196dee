"""What a router is given: its replicas, its routing policy (a ``routing`` plugin, by name,
with options validated by the plugin's own model) and how it treats failures."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from tessellm.core.errors import ConfigError, validation_problems
from tessellm.core.interfaces.routing import RoutingContext, RoutingPolicy


class RouterConfig(BaseModel):
    """A router's settings (``tessellm router`` flags)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    replicas: list[str] = Field(min_length=1)
    """Base URLs of the replicas (``http://host:port``), each a ``tessellm serve``."""
    policy: str = "prefix-aware"
    """The routing plugin that chooses a replica per request (``tessellm plugins`` lists them)."""
    policy_options: dict[str, Any] = Field(default_factory=dict)
    """The policy's options, validated by its own options model."""
    max_retries: int = Field(2, ge=0, le=16)
    """Other replicas a request is tried on after one failed before any byte reached the client."""
    health_interval_s: float = Field(1.0, gt=0, le=3600)
    """Seconds between health probes of each replica (a replica that failed comes back when
    its probe succeeds)."""
    connect_timeout_s: float = Field(5.0, gt=0)
    """Seconds to wait for a replica to accept a connection before trying another."""
    read_timeout_s: float | None = Field(None, gt=0)
    """Seconds a replica may stay silent within an answer before it counts as failed (None:
    no limit; a long prefill is silent)."""

    @field_validator("replicas")
    @classmethod
    def _urls(cls, urls: list[str]) -> list[str]:
        cleaned = [u.rstrip("/") for u in urls]
        bad = [u for u in cleaned if not u.startswith(("http://", "https://"))]
        if bad:
            raise ValueError(f"replica URL {bad[0]!r} must start with http:// or https://")
        if len(set(cleaned)) != len(cleaned):
            raise ValueError("a replica URL is given twice")
        return cleaned


def router_config(**fields: Any) -> RouterConfig:
    """``RouterConfig(**fields)``, a ConfigError naming the field when it does not validate."""
    try:
        return RouterConfig(**fields)
    except ValidationError as exc:
        raise ConfigError(f"router: {validation_problems(exc)}") from None


def load_policy(name: str, options: dict[str, Any], num_replicas: int, registry: Any = None) -> RoutingPolicy:
    """The routing plugin ``name`` built for ``num_replicas`` replicas, its ``options``
    validated; a ConfigError names an unknown policy (with the installed ones), a bad option,
    or the policy's reasons it cannot serve."""
    from tessellm.core.registry import did_you_mean, get_registry

    registry = registry or get_registry()
    entry = registry.get("routing", name)
    if entry is None:
        failures = "".join(f"; note: {f}" for f in registry.failures_for("routing", name))
        raise ConfigError(f"--policy: unknown routing policy {name!r}{did_you_mean(name, registry.names('routing'))}; "
                          f"valid choices: {', '.join(registry.names('routing')) or '(none installed)'}{failures}")
    try:
        validated = entry.cls.Options.model_validate(options)
    except ValidationError as exc:
        allowed = ", ".join(entry.cls.Options.model_fields) or "none"
        raise ConfigError(f"--policy-option: invalid for routing policy {name!r}: {validation_problems(exc)} "
                          f"(its options: {allowed})") from None
    reasons = entry.cls.unsupported_reasons(RoutingContext(num_replicas))
    if reasons:
        raise ConfigError(f"--policy {name}: cannot route among {num_replicas} replicas: {'; '.join(reasons)}")
    return entry.cls(validated, num_replicas)


def parse_policy_options(items: list[str]) -> dict[str, Any]:
    """``--policy-option KEY=VALUE`` items (values in YAML syntax: ``0.7``, ``true``) as a mapping."""
    import yaml

    options: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--policy-option {item!r}: expected KEY=VALUE, e.g. match_threshold=0.7")
        try:
            options[key.strip()] = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            options[key.strip()] = raw
    return options
