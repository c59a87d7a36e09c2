import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# The CLI quiets vLLM unless the level is set: tests that call main() in
# process keep vLLM's logs as every other test sees them.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO")
