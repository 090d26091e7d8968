"""The main job's stages that span rooms, and its recommendation stage (also run alone and by the llama.cpp
benchmark)."""
