"""Seeing eager calls: module hooks and the API-level TorchFunctionMode, and what they need to
name, filter and describe a call (see probe/capture/__init__.py)."""
