"""A pytest plugin standing in for a host stack that registers its own backend before the conformance
suite is collected (`pytest -p critic_adapters.tests.conformance.host_backend tests/conformance`):
"host_fsdp", the fsdp engine under a host's name, offering data parallel only."""

from critic_adapters.common.engine.registry import BackendSpec, register_backend

register_backend("host_fsdp", BackendSpec(factory="critic_adapters.backends.fsdp.engine:FSDPCriticEngine"),
                 replace=True)
