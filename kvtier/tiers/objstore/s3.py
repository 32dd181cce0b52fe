"""s3:// objects through boto3, with credentials only from the SDK's default chain.

On EKS that chain is IRSA (``AWS_ROLE_ARN`` and ``AWS_WEB_IDENTITY_TOKEN_FILE``: botocore trades
the projected token for temporary keys at STS and trades again, re-reading the file, before they
expire) or EKS Pod Identity. The endpoint is the SDK's too: ``AWS_ENDPOINT_URL`` or
``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL_STS`` for S3-compatible stores and VPC endpoints.
The region is ``AWS_DEFAULT_REGION``, or ``AWS_REGION`` (which EKS sets and botocore ignores).

Object metadata travels as S3 user metadata (``x-amz-meta-*``): keys come back lower-cased, and
keys and values must be ASCII.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NoReturn

import boto3.session
import botocore.config
import botocore.configloader
import botocore.exceptions
import botocore.session

from kvtier.core.errors import CredentialError, ObjectNotFoundError, ObjectStoreError
from kvtier.tiers.objstore.backend import (
    ObjectBackend,
    ObjectExistsError,
    ObjectInfo,
    RequestRejectedError,
    StoreLocation,
    StoreUnreachableError,
)

_DELETE_BATCH = 1000  # the most keys one DeleteObjects call accepts
_NOT_FOUND = frozenset({"NoSuchKey", "404", "NotFound"})
# An exclusive put (If-None-Match: *) found the name taken, or lost to a concurrent one.
_EXISTS = frozenset({"PreconditionFailed", "412", "ConditionalRequestConflict"})
# Error codes that mean the identity is wrong or its keys are no longer valid.
_CREDENTIAL_CODES = frozenset(
    {
        "AccessDenied",
        "AccessDeniedException",
        "403",
        "ExpiredToken",
        "ExpiredTokenException",
        "InvalidAccessKeyId",
        "InvalidClientTokenId",
        "InvalidIdentityToken",
        "InvalidToken",
        "SignatureDoesNotMatch",
        "TokenRefreshRequired",
        "UnrecognizedClientException",
    }
)
# Error codes S3 gives a request for what it carries (name, size, headers): the store is fine.
_REQUEST_CODES = frozenset(
    {
        "KeyTooLongError",
        "InvalidObjectName",
        "InvalidArgument",
        "InvalidRequest",
        "InvalidURI",
        "EntityTooLarge",
        "EntityTooSmall",
        "MetadataTooLarge",
        "InvalidDigest",
        "BadDigest",
        "MaxMessageLengthExceeded",
        "414",
    }
)
# Providers of botocore's default chain that hand out long-lived keys.
_STATIC_METHODS = {
    "env": "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in the environment",
    "shared-credentials-file": "aws_access_key_id in the shared credentials file",
    "config-file": "aws_access_key_id in the AWS config file",
    "ec2-credentials-file": "keys in /etc/boto.cfg-style EC2 credentials file",
    "boto-config": "keys in a boto config file",
}
# Providers that need the network (container or instance metadata): workload identities, taken
# without resolving them at start.
_NETWORK_METHODS = frozenset({"container-role", "iam-role"})
# Operations botocore's credential providers call; any failure there is an identity failure.
_CREDENTIAL_OPERATIONS = frozenset(
    {"AssumeRoleWithWebIdentity", "AssumeRole", "GetRoleCredentials"}
)
_CREDENTIAL_EXCEPTIONS: tuple[type[Exception], ...] = (
    botocore.exceptions.NoCredentialsError,
    botocore.exceptions.PartialCredentialsError,
    botocore.exceptions.CredentialRetrievalError,
    botocore.exceptions.MetadataRetrievalError,
    botocore.exceptions.RefreshWithMFAUnsupportedError,
    botocore.exceptions.TokenRetrievalError,
    botocore.exceptions.UnauthorizedSSOTokenError,
    botocore.exceptions.InvalidConfigError,
)


def _describe(exc: Exception) -> str:
    if isinstance(exc, botocore.exceptions.ClientError):
        err = exc.response.get("Error", {})
        return f"{exc.operation_name}: {err.get('Code', '')} {err.get('Message', '')}".rstrip()
    if isinstance(exc, OSError) and exc.filename is not None:
        return f"cannot read {exc.filename}: {exc.strerror}"
    return str(exc)


def _raise_mapped(exc: Exception, what: str) -> NoReturn:
    """Re-raise a boto3 failure as the kvtier error the tier acts on."""
    if isinstance(exc, botocore.exceptions.ClientError):
        code = str(exc.response.get("Error", {}).get("Code", ""))
        if code in _NOT_FOUND:
            raise ObjectNotFoundError(what) from exc
        if code in _EXISTS:
            raise ObjectExistsError(what) from exc
        if code in _CREDENTIAL_CODES or exc.operation_name in _CREDENTIAL_OPERATIONS:
            raise CredentialError(f"{what}: {_describe(exc)}") from exc
        if code in _REQUEST_CODES:
            raise RequestRejectedError(f"{what}: {_describe(exc)}") from exc
    elif isinstance(
        exc, (botocore.exceptions.EndpointConnectionError, botocore.exceptions.ConnectTimeoutError)
    ):
        raise StoreUnreachableError(f"{what}: {_describe(exc)}") from exc
    elif isinstance(exc, _CREDENTIAL_EXCEPTIONS) or (
        # botocore reads the web identity token file with a plain open(): a missing or
        # unreadable file escapes as an OSError that names it
        isinstance(exc, OSError) and exc.filename is not None
    ):
        raise CredentialError(f"{what}: {_describe(exc)}") from exc
    raise ObjectStoreError(f"{what}: {_describe(exc)}") from exc


def _assume_role_source(core: botocore.session.Session) -> str | None:
    """A profile's role_arn is assumed with other credentials: static when they are keys."""
    profiles = core.full_config.get("profiles", {})
    try:
        path = os.path.expanduser(str(core.get_config_variable("credentials_file")))
        keyed = botocore.configloader.raw_config_parse(path)
    except (botocore.exceptions.ConfigNotFound, botocore.exceptions.ConfigParseError):
        keyed = {}
    name = core.get_config_variable("profile") or "default"
    seen: set[str] = set()
    while name not in seen:
        seen.add(name)
        profile = profiles.get(name, {})
        if profile.get("credential_source") == "Environment":
            return f"profile {name}: role_arn assumed with AWS_ACCESS_KEY_ID from the environment"
        if "aws_access_key_id" in profile or "aws_access_key_id" in keyed.get(name, {}):
            return f"profile {name}: role_arn assumed with long-lived keys"
        source = profile.get("source_profile")
        if source is None:
            return None
        name = source
    return None


def _is_not_found(exc: Exception) -> bool:
    return (
        isinstance(exc, botocore.exceptions.ClientError)
        and exc.response.get("Error", {}).get("Code") in _NOT_FOUND
    )


# What a boto3 call can raise besides our own errors; anything else is a bug and propagates.
_SDK_ERRORS: tuple[type[Exception], ...] = (botocore.exceptions.BotoCoreError, OSError)
_CALL_ERRORS: tuple[type[Exception], ...] = (botocore.exceptions.ClientError, *_SDK_ERRORS)
# The request never got an answer (or could not be signed for lack of a region).
_UNREACHABLE: tuple[type[Exception], ...] = (
    botocore.exceptions.HTTPClientError,
    botocore.exceptions.ConnectionError,
    botocore.exceptions.NoRegionError,
)


class S3Backend(ObjectBackend):
    """One bucket and prefix. Each call is one request (or one page), with no SDK retries."""

    def __init__(self, location: StoreLocation, timeout_s: float) -> None:
        super().__init__(location, timeout_s)
        self._prefix = f"{location.prefix}/" if location.prefix else ""
        config = botocore.config.Config(
            connect_timeout=timeout_s,
            read_timeout=timeout_s,
            # total_max_attempts counts the first request; max_attempts would mean one retry
            retries={"total_max_attempts": 1, "mode": "standard"},
            max_pool_connections=64,
        )
        core = botocore.session.Session()
        # The session's default config reaches the STS client botocore builds for the
        # web-identity exchange too, so a hung STS is bounded by the same timeout.
        core.set_default_client_config(config)
        region = None if core.get_config_variable("region") else os.environ.get("AWS_REGION")
        try:
            self._session = boto3.session.Session(botocore_session=core, region_name=region)
            self._s3: Any = self._session.client("s3", config=config)
        except _CALL_ERRORS as exc:
            _raise_mapped(exc, f"creating the S3 client for {self.url}")
        self._sts: Any = None
        self._sts_lock = threading.Lock()

    def _key(self, name: str) -> str:
        return self._prefix + name

    def _resolve_credentials(self) -> Any:
        """Make sure the keys are current before a request. botocore would do it inside the
        request, where an STS or token-file failure looks like a store failure (the same
        endpoint may serve both); here every failure is the identity's. Cheap while the keys
        are fresh."""
        credentials = self._session.get_credentials()
        if credentials is None:
            raise CredentialError(
                "no AWS credentials: set up IRSA (AWS_ROLE_ARN and AWS_WEB_IDENTITY_TOKEN_FILE) "
                "or EKS Pod Identity"
            )
        try:
            credentials.get_frozen_credentials()
        except _CALL_ERRORS as exc:
            raise CredentialError(
                f"resolving AWS credentials ({credentials.method}): {_describe(exc)}"
            ) from exc
        return credentials

    def put(
        self,
        name: str,
        body: bytes | memoryview,
        metadata: Mapping[str, str],
        exclusive: bool = False,
    ) -> None:
        self.check_name(name)
        data = body if isinstance(body, bytes) else bytes(body)
        kwargs: dict[str, Any] = {"IfNoneMatch": "*"} if exclusive else {}
        self._resolve_credentials()
        try:
            self._s3.put_object(
                Bucket=self.location.bucket,
                Key=self._key(name),
                Body=data,
                Metadata=dict(metadata),
                **kwargs,
            )
        except _CALL_ERRORS as exc:
            _raise_mapped(exc, f"put {self._key(name)}")

    def get(self, name: str, start: int = 0, length: int | None = None) -> bytes:
        self.check_name(name)
        key = self._key(name)
        if length == 0:
            if self.head(name) is None:
                raise ObjectNotFoundError(key)
            return b""
        kwargs: dict[str, Any] = {"Bucket": self.location.bucket, "Key": key}
        if length is not None:
            kwargs["Range"] = f"bytes={start}-{start + length - 1}"
        elif start:
            kwargs["Range"] = f"bytes={start}-"
        self._resolve_credentials()
        try:
            response = self._s3.get_object(**kwargs)
            stream = response["Body"]
            try:
                data: bytes = stream.read()
            finally:
                stream.close()
            return data
        except _CALL_ERRORS as exc:
            if (
                isinstance(exc, botocore.exceptions.ClientError)
                and exc.response.get("Error", {}).get("Code") == "InvalidRange"
            ):
                return b""  # starts at or past the end, as a file read would
            _raise_mapped(exc, f"get {key}")

    def head(self, name: str) -> ObjectInfo | None:
        self.check_name(name)
        self._resolve_credentials()
        try:
            response = self._s3.head_object(Bucket=self.location.bucket, Key=self._key(name))
        except _CALL_ERRORS as exc:
            if _is_not_found(exc):
                return None
            _raise_mapped(exc, f"head {self._key(name)}")
        return ObjectInfo(
            name,
            int(response["ContentLength"]),
            response["LastModified"].timestamp(),
            dict(response.get("Metadata", {})),
        )

    def delete(self, names: Sequence[str]) -> None:
        for i in range(0, len(names), _DELETE_BATCH):
            batch = [{"Key": self._key(n)} for n in names[i : i + _DELETE_BATCH]]
            self._resolve_credentials()
            try:
                response = self._s3.delete_objects(
                    Bucket=self.location.bucket, Delete={"Objects": batch, "Quiet": True}
                )
            except _CALL_ERRORS as exc:
                _raise_mapped(exc, f"delete {len(batch)} objects under {self.url}")
            errors = [e for e in response.get("Errors", []) if e.get("Code") not in _NOT_FOUND]
            if errors:
                first = errors[0]
                message = (
                    f"delete {first.get('Key')}: {first.get('Code')} {first.get('Message', '')}"
                    f" ({len(errors)} of {len(batch)} failed)"
                )
                if first.get("Code") in _CREDENTIAL_CODES:
                    raise CredentialError(message)
                raise ObjectStoreError(message)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        self._resolve_credentials()
        paginator = self._s3.get_paginator("list_objects_v2")
        pages = paginator.paginate(Bucket=self.location.bucket, Prefix=self._key(prefix))
        cut = len(self._prefix)
        try:
            for page in pages:
                for obj in page.get("Contents", []):
                    yield ObjectInfo(
                        obj["Key"][cut:], int(obj["Size"]), obj["LastModified"].timestamp()
                    )
        except _CALL_ERRORS as exc:
            _raise_mapped(exc, f"list {self._key(prefix)}*")

    def static_credentials(self) -> str | None:
        """Walks botocore's chain in its order up to the first provider that has keys, without
        the providers that need the network."""
        core = self._session._session
        resolver: Any = core.get_component("credential_provider")
        profiles = core.full_config.get("profiles", {})
        profile = profiles.get(core.get_config_variable("profile") or "default", {})
        for provider in resolver.providers:
            method = getattr(provider, "METHOD", "")
            if method in _NETWORK_METHODS:
                return None
            if method == "custom-process":  # a program of the operator's; not run here
                if "credential_process" in profile:
                    return None
                continue
            if method == "assume-role":  # judged from the config: loading it may fail here
                if "role_arn" in profile and (
                    "source_profile" in profile or "credential_source" in profile
                ):
                    return _assume_role_source(core)
                continue
            try:
                found = provider.load()
            except _CALL_ERRORS:
                continue  # botocore would fail here too; principal() reports it
            if found is None:
                continue
            return _STATIC_METHODS.get(method)
        return None

    def principal(self) -> str:
        credentials = self._resolve_credentials()
        with self._sts_lock:
            if self._sts is None:
                try:
                    self._sts = self._session.client("sts")
                except _CALL_ERRORS as exc:
                    _raise_mapped(exc, "creating the STS client")
        try:
            arn: str = self._sts.get_caller_identity()["Arn"]
            return arn
        except _CALL_ERRORS as exc:
            code = (
                exc.response.get("Error", {}).get("Code")
                if isinstance(exc, botocore.exceptions.ClientError)
                else None
            )
            if isinstance(exc, _UNREACHABLE) or (
                code is not None and code not in _CREDENTIAL_CODES
            ):
                # STS unreachable (no VPC endpoint, say) or failing while the keys are fine:
                # name the credential method instead
                return f"aws:{credentials.method}"
            _raise_mapped(exc, "GetCallerIdentity")

    def close(self) -> None:
        self._s3.close()
        if self._sts is not None:
            self._sts.close()
