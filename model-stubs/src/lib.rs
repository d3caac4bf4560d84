//! The five Qwen3-Omni stage stubs.
