//! The transfer engine.
