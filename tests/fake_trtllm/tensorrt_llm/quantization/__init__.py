"""Fake ``tensorrt_llm.quantization``: ``QuantAlgo`` (the members qwen-trt names; upstream's is a
``StrEnum`` in tensorrt_llm/quantization/mode.py, values equal to the names)."""
from enum import Enum


class QuantAlgo(str, Enum):
    W8A16 = "W8A16"
    W4A16 = "W4A16"
    W4A16_AWQ = "W4A16_AWQ"
    W4A8_AWQ = "W4A8_AWQ"
    W8A8_SQ_PER_CHANNEL = "W8A8_SQ_PER_CHANNEL"
    FP8 = "FP8"
    FP8_PER_CHANNEL_PER_TOKEN = "FP8_PER_CHANNEL_PER_TOKEN"
    FP8_BLOCK_SCALES = "FP8_BLOCK_SCALES"
    NVFP4 = "NVFP4"
    INT8 = "INT8"

    def __str__(self) -> str:
        return self.value


# PretrainedModel.quantize (tensorrt_llm/models/modeling_utils.py): these need ModelOpt and a
# calibration set; W4A16 / W8A16 / None are converted natively by from_hugging_face.
MODELOPT_FLOW = (QuantAlgo.W4A16_AWQ, QuantAlgo.FP8, QuantAlgo.W8A8_SQ_PER_CHANNEL,
                 QuantAlgo.W4A8_AWQ)
