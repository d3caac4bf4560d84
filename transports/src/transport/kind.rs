//! The kinds of transport this build knows, by name. The one place transport names are spelled:
//! YAML scenarios, the command line, segment descriptors and reports all go through
//! [`TransportKind`], so an unknown name is an error that lists the valid ones instead of
//! silently meaning something else.
//!
//! Adding a transport: a variant here (and its name in [`TransportKind::as_str`] /
//! [`TransportKind::ALL`]), its module under `transport/`, and one line in
//! [`crate::transport::default_setup`].

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::{Error, ErrorKind};

/// A transport, by kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TransportKind {
    /// Engines of one process: one memcpy per slice.
    Loopback,
    /// Any two engines that can open a TCP connection.
    Tcp,
    /// Engines of one host: the grant owner copies through a sealed memfd.
    Shm,
    /// Engines on hosts with an RDMA device: one-sided verbs into fenced grants (cargo feature
    /// `rdma`; a build without it refuses to start this transport, naming the feature).
    Rdma,
    /// Engines of one host with CUDA GPUs: the grant owner copies device to device (CUDA IPC
    /// across processes, peer copies between GPUs) under the grant's fence (cargo feature
    /// `cuda`; a build without it refuses to start this transport, naming the feature).
    Cuda,
    /// Engines of one process on a modelled fabric (links, NICs, latency, bandwidth, queues):
    /// bytes really copied, time from tokio's clock, virtual when it is paused.
    Sim,
}

impl TransportKind {
    /// Every kind this build knows, in order of preference when several reach a peer (same
    /// process, same host, an RDMA fabric, anywhere), but for cuda (see [`Self::preference`]).
    pub const ALL: &'static [TransportKind] = &[
        TransportKind::Loopback,
        TransportKind::Shm,
        TransportKind::Rdma,
        TransportKind::Tcp,
        TransportKind::Cuda,
        TransportKind::Sim,
    ];

    /// The kind's name, as written in scenarios, on the command line and in reports.
    pub const fn as_str(self) -> &'static str {
        match self {
            TransportKind::Loopback => "loopback",
            TransportKind::Tcp => "tcp",
            TransportKind::Shm => "shm",
            TransportKind::Rdma => "rdma",
            TransportKind::Cuda => "cuda",
            TransportKind::Sim => "sim",
        }
    }

    /// Lower is preferred when several reach a peer: the order of [`TransportKind::ALL`],
    /// except that cuda (listed last, after the kinds every build had) ranks right after
    /// loopback: engines of one host with GPUs copy device to device.
    pub fn preference(self) -> usize {
        match self {
            TransportKind::Loopback => 0,
            TransportKind::Cuda => 1,
            k => {
                1 + Self::ALL
                    .iter()
                    .position(|&x| x == k)
                    .expect("every kind is in ALL")
            }
        }
    }

    /// Whether engines of two processes can use it (loopback and sim cannot).
    pub const fn crosses_processes(self) -> bool {
        !matches!(self, TransportKind::Loopback | TransportKind::Sim)
    }

    /// The valid names, comma separated, for error messages.
    pub fn names() -> String {
        Self::ALL
            .iter()
            .map(|k| k.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The kinds that cross processes, comma separated, for error messages.
    pub fn process_names() -> String {
        Self::ALL
            .iter()
            .filter(|k| k.crosses_processes())
            .map(|k| k.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    }
}

impl fmt::Display for TransportKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for TransportKind {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        Self::ALL
            .iter()
            .copied()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::Malformed,
                    format!(
                        "unknown transport {s:?} (this build knows: {})",
                        Self::names()
                    ),
                )
            })
    }
}

impl Serialize for TransportKind {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for TransportKind {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Name;
        impl serde::de::Visitor<'_> for Name {
            type Value = TransportKind;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "a transport name ({})", TransportKind::names())
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<TransportKind, E> {
                v.parse().map_err(|e: Error| E::custom(e.detail()))
            }
        }
        d.deserialize_str(Name)
    }
}

#[cfg(feature = "clap")]
impl clap::ValueEnum for TransportKind {
    fn value_variants<'a>() -> &'a [Self] {
        Self::ALL
    }

    fn to_possible_value(&self) -> Option<clap::builder::PossibleValue> {
        Some(clap::builder::PossibleValue::new(self.as_str()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_names_list_the_valid_ones() {
        for &k in TransportKind::ALL {
            assert_eq!(k.as_str().parse::<TransportKind>().unwrap(), k);
            assert_eq!(k.to_string(), k.as_str());
            let wire = rmp_serde::to_vec(&k).unwrap();
            assert_eq!(rmp_serde::from_slice::<TransportKind>(&wire).unwrap(), k);
        }
        let e = "rdmaa".parse::<TransportKind>().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Malformed);
        for &k in TransportKind::ALL {
            assert!(e.to_string().contains(k.as_str()), "{e}");
        }
        assert!(e.to_string().contains("rdmaa"), "{e}");
        let mut by_preference = TransportKind::ALL.to_vec();
        by_preference.sort_by_key(|k| k.preference());
        use TransportKind::*;
        assert_eq!(by_preference, [Loopback, Cuda, Shm, Rdma, Tcp, Sim]);
        let bad = rmp_serde::to_vec("carrier pigeon").unwrap();
        let e = rmp_serde::from_slice::<TransportKind>(&bad).unwrap_err();
        assert!(e.to_string().contains("tcp"), "{e}");
    }
}
