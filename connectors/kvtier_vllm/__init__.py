"""kvtier's vLLM connector.

Load it with ``"kv_connector": "KVTierConnector"`` and
``"kv_connector_module_path": "kvtier_vllm.connector"``.
"""
