"""Envoy bootstrap templates (installed as ``inferlb.envoy``; rendered by ``inferlb.envoyconf``).

Run from the repository root, ``import envoy`` would find this folder before Envoy's generated protos
(the ``envoy`` package of xds-protos). Extending ``__path__`` pkgutil-style lets both be found either way.
"""

__path__ = __import__("pkgutil").extend_path(__path__, __name__)
