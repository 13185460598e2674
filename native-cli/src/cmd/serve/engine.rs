//! The API server's side of core's continuous-batching engine
//! ([`nibble_core::models::llama::engine`]): a request's events go to its channel.

pub(super) use nibble_core::models::llama::engine::{Engine, Event, EventSink, Job, Shared};
use tokio::sync::mpsc::UnboundedSender;

/// A request's channel, as the engine's event sink.
pub(super) struct Client(pub UnboundedSender<Event>);

impl EventSink for Client {
    fn send(&self, event: Event) -> bool {
        self.0.send(event).is_ok()
    }

    fn is_closed(&self) -> bool {
        self.0.is_closed()
    }
}
