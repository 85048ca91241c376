//! Authentication: the token every call and watch carries, taken from etcd's `Authenticate`
//! with the client's [`Credentials`] when the first one is needed, and again when etcd refuses
//! it (a simple token expires after `--auth-token-ttl` unused and when the user's password
//! changes; every token when etcd restarts). The token is the cluster's, not a member's, so it
//! is kept across endpoints.

use std::sync::Arc;

use super::answer::{AUTH_NOT_ENABLED, Failure};
use super::wire::{self, AuthenticateCall, AuthenticateRequest, Method as _};
use super::{Client, Credentials, EtcdError};

/// A client's credentials and the token they got.
pub(crate) struct Auth {
    credentials: Credentials,
    /// Held across an authentication, so that callers that find the token refused together
    /// wait for one new token instead of each asking for its own (etcd checks every password
    /// with bcrypt, slow on purpose).
    token: tokio::sync::Mutex<Token>,
}

#[derive(Clone, PartialEq, Eq)]
enum Token {
    /// Not asked for yet, or the last authentication failed.
    Unknown,
    /// etcd has authentication off: calls carry no token.
    Off,
    Held(Arc<str>),
}

impl Token {
    fn get(&self) -> Option<Arc<str>> {
        match self {
            Token::Held(token) => Some(token.clone()),
            Token::Unknown | Token::Off => None,
        }
    }
}

impl Auth {
    pub(crate) fn new(credentials: Credentials) -> Auth {
        Auth { credentials, token: tokio::sync::Mutex::new(Token::Unknown) }
    }

    pub(crate) fn user(&self) -> &str {
        &self.credentials.username
    }
}

impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The token is a bearer secret like the password.
        f.debug_struct("Auth").field("user", &self.credentials.username).finish_non_exhaustive()
    }
}

impl Client {
    /// The token for a request to `endpoint`: none without credentials or while etcd has
    /// authentication off; else the one held, or a new one from `endpoint`.
    pub(crate) async fn token(&self, endpoint: &str) -> Result<Option<Arc<str>>, Failure> {
        let Some(auth) = self.auth() else { return Ok(None) };
        let mut held = auth.token.lock().await;
        if *held == Token::Unknown {
            *held = self.authenticate(auth, endpoint).await?;
        }
        Ok(held.get())
    }

    /// A token to use instead of `refused`, which etcd would not take: a new one from
    /// `endpoint`, unless another call has renewed it meanwhile.
    pub(crate) async fn renew(&self, endpoint: &str, refused: Option<Arc<str>>) -> Result<Option<Arc<str>>, Failure> {
        let Some(auth) = self.auth() else { return Ok(None) };
        let mut held = auth.token.lock().await;
        if held.get() == refused {
            *held = Token::Unknown;
            *held = self.authenticate(auth, endpoint).await?;
        }
        Ok(held.get())
    }

    async fn authenticate(&self, auth: &Auth, endpoint: &str) -> Result<Token, Failure> {
        let request = AuthenticateRequest {
            name: auth.credentials.username.clone(),
            password: auth.credentials.password.expose().to_owned(),
        };
        match self.unary::<AuthenticateCall>(endpoint, request, None, true).await {
            Ok(answer) if answer.token.is_empty() => {
                Err(Failure::Final(wire::malformed(AuthenticateCall::PATH, "an empty token")))
            }
            Ok(answer) => Ok(Token::Held(answer.token.into())),
            // As etcd's own client does: with authentication off, calls need no token. Should
            // it be turned on later, calls are refused with "user name is empty", which renews.
            Err(Failure::Final(EtcdError::Refused { message, .. })) if message.contains(AUTH_NOT_ENABLED) => {
                Ok(Token::Off)
            }
            // A refusal of the credentials themselves ("user name is empty" for an empty name)
            // is final: authenticating again would not change it.
            Err(Failure::Token(e)) => Err(Failure::Final(e)),
            // Whatever became of the authentication, the call it was for has not been sent:
            // another member may take both.
            Err(Failure::Unknown(e)) => Err(Failure::Elsewhere(e)),
            Err(other) => Err(other),
        }
    }
}
