"""The demo: the shipped WeDLM model (demo/model) and everything that makes, ships and judges it.

    python -m demo                 `make demo`: decode held-out prompts side by side (demo/run.py)
    python -m demo.data            the training data, tokenizer and held-out eval set (demo/data.py)
    python -m demo.pipeline        data -> pretrain -> convert round trip -> adapt -> held-out eval,
                                   for a target: one GPU, or any CPU at toy size (demo/pipeline.py)
    python -m demo.heldout         every regime x AR / streaming / verified on held-out prompts
    python -m demo.ship            a finished run's model folder into demo/model (curves, manifest)
    demo.eval                      check_model / load_model / eval_items / decode_items / scoring
"""
