//! Connectors, pipeline runner, scenarios and reports.
