"""An alias: the module path ``dualpath vllm-config`` printed before the connector moved to
``dualpath.vllm.served``, so that a ``--kv-transfer-config`` written then still loads
(``"kv_connector_module_path": "dualpath.cluster.served"``). New configs name
``dualpath.vllm.served``; nothing in the package imports this module.
"""

from dualpath.vllm.served import DualpathServedConnector

__all__ = ["DualpathServedConnector"]
