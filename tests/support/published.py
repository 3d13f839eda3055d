"""Parameter counts of published models, as the issues give them from transformers and the model cards."""

QWEN3_PUBLISHED = {  # parameters (total, active per token), as issue 37 gives them
    "qwen3_0_6b": (596_049_920, 596_049_920),
    "qwen3_1_7b": (1_720_574_976, 1_720_574_976),
    "qwen3_4b": (4_022_468_096, 4_022_468_096),
    "qwen3_8b": (8_190_735_360, 8_190_735_360),
    "qwen3_14b": (14_768_307_200, 14_768_307_200),
    "qwen3_32b": (32_762_123_264, 32_762_123_264),
    "qwen3_30b_a3b": (30_532_122_624, 3_353_032_704),
    "qwen3_235b_a22b": (235_093_634_560, 22_190_763_520),
}
