"""kvtier's vLLM connectors.

Load the KV connector with ``"kv_connector": "KVTierConnector"`` and
``"kv_connector_module_path": "kvtier_vllm.connector"``, the encoder-cache connector with
``"ec_connector": "KVTierECConnector"`` and ``"ec_connector_module_path":
"kvtier_vllm.ec_connector"``. Their parts sit in ``shared``, ``layout``, ``kv``, ``drafts``,
``hidden_capture`` and ``encoder``.
"""
