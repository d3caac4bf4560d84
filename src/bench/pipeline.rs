//! `omnirig bench pipeline` (filled in below).
