"""qwen-trt: low-latency chat for Qwen3-4B-Instruct-2507 on one NVIDIA GPU.

Data flows one way: checkpoint -> export -> engine build -> runtime backend -> chat session -> UI.
"""

__version__ = "0.1.0"
