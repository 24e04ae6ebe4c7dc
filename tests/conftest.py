pytest_plugins = ("tests.support.vllm_servers",)
