//! Tool calls in model output: streaming XML parsing, schema typing and call ids.

mod ids;
pub mod param_schema;
mod parser;
mod typing;

pub use ids::CallIds;
pub use parser::{ParsedCall, ToolCallParser, ToolEvent, writable_name};
pub use typing::type_value;
