"""What models and transforms share, with no model in it: the causal attention core that context
parallelism swaps (attention.py), routed experts held in NF4 as QLoRA stores them (nf4_experts.py),
per-parameter seeds that make initialisation independent of order and layout (init.py), the
router's name and the names of a stack of routed experts' weights. Models and `parallelisms/`, `float8/` import it; it imports only torch."""

# The attribute name of an MoE layer's router (models/common/moe.py): LoRA and float8 leave layers of
# this name as they are (an adapter or float8 rounding there would move the routing).
ROUTER = "router"
# The stacked weights of routed experts (models/common/moe.py: GroupedExperts), [experts, out, in]
# each: what LoRA adapts, NF4 quantizes and expert parallelism spreads.
EXPERT_WEIGHTS = ("w1", "w2", "w3")
