//! `omnirig bench ...`
