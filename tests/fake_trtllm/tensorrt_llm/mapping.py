"""Fake ``tensorrt_llm.mapping.Mapping`` (imported from there by runtime/model_runner_cpp.py
@03832911); keyword arguments as used by examples/models/core/qwen/convert_checkpoint.py."""


class Mapping:
    def __init__(self, world_size=1, rank=0, gpus_per_node=8, *, cp_size=1, tp_size=1,
                 pp_size=1, moe_tp_size=-1, moe_ep_size=-1, **kwargs):
        if world_size != tp_size * pp_size * cp_size:
            raise ValueError(f"world_size {world_size} != tp {tp_size} x pp {pp_size} x cp {cp_size}")
        self.world_size, self.rank, self.tp_size, self.pp_size = world_size, rank, tp_size, pp_size
        self.cp_size = cp_size

    def to_dict(self):
        return {"world_size": self.world_size, "tp_size": self.tp_size, "pp_size": self.pp_size}
