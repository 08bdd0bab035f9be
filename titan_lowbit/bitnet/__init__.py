"""BitNet b1.58 training: weight subclass, converter, FSDP2 hooks."""
