"""The static plan a Decoder is built on, made and checked once before anything compiles: the
plan itself (plan), the memory it needs beside the weights (memory) and the weights' layouts
(layouts)."""
