"""The demo: the shipped WeDLM model (demo/model) and everything that makes, ships and judges it.

    python -m demo                 `make demo`: decode held-out prompts side by side (demo/run.py)
    python -m demo.data            the training data, tokenizer and held-out eval set (demo/data.py)
    demo/pipeline.sh               pretrain -> convert round trip -> adapt -> decode (configs/demo_*.yaml)
    python -m demo.ship            copy a finished run into demo/model with curves and manifest
    demo.eval                      check_model / load_model / eval_items / decode_items / scoring
"""
