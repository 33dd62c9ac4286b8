//! Text in and out: tokenizer and chat templates.

pub mod chat;
pub mod tokenizer;

pub use chat::{ChatMessage, ChatTemplate, ChatTemplateLimits};
pub use tokenizer::Tokenizer;
