//! The shape of `report.json` (field names and value types, values redacted) as a reviewed
//! snapshot under `golden/snapshots/`: a schema change shows up in `cargo insta review` like
//! any golden data, instead of silently breaking the tools that read reports.
//!
//! The run behind it has a healthy request and one a late write makes time out, so every
//! optional part (a failure, the fault report, held-back bytes) is present.

use omnirig_harness::faults::{AnyFault, FaultSpec};
use omnirig_harness::{Runner, Scenario};
use omnirig_transports::{FaultKind, FaultPoint, TransportKind};
use serde_json::{Map, Value};

/// The value's shape: objects keep their keys with each value's shape, arrays become the
/// merged shape of all their elements, leaves become their JSON type's name. Nulls and absent
/// fields say nothing about a type, so they merge away (a field only ever null stays `null`):
/// the snapshot lists every field that had a value in the run, with that value's type, and
/// does not depend on which request happened to leave which optional field empty.
fn shape(v: &Value) -> Value {
    match v {
        Value::Null => Value::String("null".into()),
        Value::Bool(_) => Value::String("bool".into()),
        Value::Number(_) => Value::String("number".into()),
        Value::String(_) => Value::String("string".into()),
        Value::Array(items) => {
            let merged = items.iter().map(shape).reduce(|a, b| merge(&a, &b));
            Value::Array(merged.into_iter().collect())
        }
        Value::Object(m) => Value::Object(m.iter().map(|(k, v)| (k.clone(), shape(v))).collect()),
    }
}

fn merge(a: &Value, b: &Value) -> Value {
    let null = Value::String("null".into());
    match (a, b) {
        (x, y) if *y == null => x.clone(),
        (x, y) if *x == null => y.clone(),
        (Value::Object(x), Value::Object(y)) => {
            let mut out = Map::new();
            for k in x.keys().chain(y.keys()) {
                let v = match (x.get(k), y.get(k)) {
                    (Some(p), Some(q)) => merge(p, q),
                    (Some(p), None) | (None, Some(p)) => p.clone(),
                    (None, None) => unreachable!("key from one of the two"),
                };
                out.insert(k.clone(), v);
            }
            Value::Object(out)
        }
        (Value::Array(x), Value::Array(y)) => {
            let all = x.iter().chain(y).cloned().reduce(|p, q| merge(&p, &q));
            Value::Array(all.into_iter().collect())
        }
        // Two different leaf types, or a leaf and a structure: both, so the snapshot shows it.
        (p, q) if p != q => Value::String(format!("{p}|{q}")),
        (p, _) => p.clone(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn report_json_has_the_reviewed_shape() {
    let mut s = Scenario::golden("text_short", TransportKind::Loopback);
    s.name = "report-shape".into();
    s.hop_timeout_s = 1.0;
    s.request_timeout_s = 5.0;
    s.requests.push(s.requests[0].clone());
    s.requests[1].vary_seed = true;
    s.faults = vec![FaultSpec {
        hop: "kv_cache".into(),
        request: 0,
        tensor: None,
        at: FaultPoint::AfterBytes(4096),
        kind: AnyFault::Transport(FaultKind::LateWrite),
        times: 1,
    }];
    let r = Runner::new(s).run().await.unwrap();
    assert_eq!(
        (r.summary.ok, r.summary.failed),
        (1, 1),
        "{}",
        r.summary_text()
    );
    let dir = std::env::temp_dir().join(format!("omnirig-report-shape-{}", std::process::id()));
    let path = r.write(&dir).unwrap();
    let json: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    insta::with_settings!({
        snapshot_path => "../../golden/snapshots",
        prepend_module_to_snapshot => false,
        omit_expression => true,
    }, {
        insta::assert_yaml_snapshot!("report_json_shape", shape(&json));
    });
}
